"""The DHT records' schema: what readers and the validator every node installs refuse, and how."""

import pydantic.v1 as pydantic
import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from swarm.dht.node import schema_validator
from swarm.dht.records import AccusationRecord, EventRecord, PeerRecord, TrainerRecord

PEER = {
    "peer_id": "QmPeer",
    "state": "online",
    "address": "127.0.0.1:5000",
    "throughput": 12.5,
    "queue": 0,
    "step": 3,
    "version": "0.1.0",
    "device": "cpu",
    "cert": None,
}


@pytest.mark.parametrize("model", [PeerRecord, EventRecord, TrainerRecord, AccusationRecord])
@pytest.mark.parametrize("value", [{1: "x"}, [[1, "x"]], {**PEER, b"step": 1}])
def test_keys_that_are_not_strings_are_a_validation_error(model, value):
    # found by the fuzzer (docs/FUZZING.md): pydantic's parse_obj raised TypeError "keywords must be
    # strings", past the readers' except ValidationError
    with pytest.raises(pydantic.ValidationError):
        model.parse_obj(value)


def _record(field: str, subkey, value) -> DHTRecord:
    key = DHTID.generate(source=f"run_{field}").to_bytes()
    return DHTRecord(key, MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), 0.0)


def test_the_schema_validator_refuses_what_it_cannot_read():
    validator = schema_validator("run")
    assert validator.validate(_record("stage_0", b"owner", PEER)) is True
    assert validator.validate(_record("stage_0", b"owner", {**PEER, "step": -1})) is False
    # found by the fuzzer: a subkey that is msgpack of a list made hivemind's SchemaValidator raise
    # TypeError "unhashable type: 'list'" (the store or get carrying it failed) instead of refusing it
    assert validator.validate(_record("stage_0", [1, 2], PEER)) is False
    assert validator.validate(_record("stage_0", {"a": 1}, PEER)) is False
