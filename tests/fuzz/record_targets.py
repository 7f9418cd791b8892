"""Fuzz target of the DHT records (swarm/dht/records.py): `PeerRecord`, `EventRecord` and
`TrainerRecord.parse_obj`, and the schema validator swarm/dht/node.py installs on every node
(`schema_validator`: hivemind's `SchemaValidator` with `SwarmSchema`).

Cases: records near the schema with fields replaced by anything (nested dicts and lists, bytes, huge
ints, NaN, long strings), dropped or added; any value; DHT records whose key is one of the swarm's
(or not), whose subkey and value are msgpack of anything, raw bytes, or mutated valid records.

Contract: parse_obj raises only pydantic's ValidationError, and what it accepts holds the declared
types and bounds (and parses again to itself). The validator answers a bool; a value it accepts under
a stage, events or trainers key parses with the reader's model raising nothing but ValidationError
(swarm/dht/node.py catches only that).
"""

from __future__ import annotations

import functools
import math
import random

import pydantic.v1 as pydantic
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import strategies as st

from swarm.core.states import PeerState
from swarm.dht.node import schema_validator
from swarm.dht.records import EventRecord, PeerRecord, TrainerRecord
from tests.fuzz import strategies as fs
from tests.fuzz.harness import Target
from tests.fuzz.wire_targets import expect

RUN = "fuzzrun"
MODELS = {"peer": PeerRecord, "events": EventRecord, "trainer": TrainerRecord}
VALID = {
    "peer": {
        "peer_id": "QmFuzzPeer",
        "state": "online",
        "address": "127.0.0.1:5000",
        "throughput": 12.5,
        "queue": 0,
        "step": 3,
        "version": "0.1.0",
        "device": "cpu",
    },
    "events": {"events": ["join stage 0", "move 0 -> 1"]},
    "trainer": {"trainer_id": "t0", "step": 4, "loss": 2.5, "samples_per_s": 10.0, "failed_peers": [["abc", 2]]},
}
FIELDS = {"stage_0": "peer", "stage_63": "peer", "events": "events", "trainers": "trainer", "config": None}


@st.composite
def record_values(draw, kind: str):
    """A record near `kind`'s schema: up to three fields replaced, dropped or added; or anything."""
    if draw(st.sampled_from(range(5))) == 4:
        return draw(fs.PYTHON_VALUES)
    value = dict(VALID[kind])
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(("set", "set", "drop", "extra")))
        key = draw(st.sampled_from(sorted(value, key=repr))) if value else "step"
        if op == "set":
            value[key] = draw(fs.PYTHON_VALUES)
        elif op == "drop":
            value.pop(key, None)
        else:
            value[draw(fs.HASHABLE)] = draw(fs.PACKABLE_VALUES)
    return value


@st.composite
def _packable_record(draw, kind: str | None) -> bytes:
    value = draw(record_values(kind)) if kind and draw(st.booleans()) else draw(fs.PACKABLE_VALUES)
    try:
        return MSGPackSerializer.dumps(value)
    except (OverflowError, TypeError, ValueError):  # a Python value msgpack cannot carry
        return MSGPackSerializer.dumps(None)


def _subkeys() -> st.SearchStrategy[bytes]:
    owner = st.binary(min_size=1, max_size=40).map(MSGPackSerializer.dumps)
    anything = fs.PACKABLE_VALUES.map(MSGPackSerializer.dumps)
    return st.one_of(owner, st.just(MSGPackSerializer.dumps(None)), st.just(b""), anything, st.binary(max_size=20))


@st.composite
def dht_records(draw) -> tuple:
    field = draw(st.sampled_from((*FIELDS, "unrelated")))
    values = st.one_of(_packable_record(FIELDS.get(field)), st.binary(max_size=60))
    value = draw(fs.mutated(values, max_ops=2) if draw(st.sampled_from(range(4))) == 3 else values)
    return ("validator", field, draw(_subkeys()), value)


def record_cases() -> st.SearchStrategy:
    kinds = st.sampled_from(sorted(MODELS))
    parsed = kinds.flatmap(lambda k: st.tuples(st.just("parse"), st.just(k), record_values(k)))
    return st.one_of(parsed, dht_records())


def _check_accepted(kind: str, record: pydantic.BaseModel) -> None:
    expect(type(record).parse_obj(record.dict()) == record, f"an accepted {kind} record does not parse to itself")
    if kind == "peer":
        expect(isinstance(record.queue, int) and not isinstance(record.queue, bool), "queue is not an int")
        expect(isinstance(record.step, int) and record.step >= 0, "step is not a non-negative int")
        t = record.throughput
        expect(isinstance(t, float) and not math.isnan(t) and t >= 0, f"a throughput out of bounds\n{t!r}")
        expect(record.state in {s.value for s in PeerState}, f"an unknown state\n{record.state!r}")
        expect(len(record.peer_id) <= 80 and len(record.address) <= 200, "a string over its length")
    elif kind == "events":
        expect(len(record.events) <= 16 and all(isinstance(e, str) for e in record.events), "events")


def _parse(kind: str, value) -> str:
    try:
        record = MODELS[kind].parse_obj(value)
    except pydantic.ValidationError:
        return f"{kind} rejected"
    _check_accepted(kind, record)
    return f"{kind} accepted"


@functools.cache
def validator():
    return schema_validator(RUN)


def _validate(field: str, subkey: bytes, value: bytes) -> str:
    key = DHTID.generate(source=f"{RUN}_{field}").to_bytes()
    accepted = validator().validate(DHTRecord(key, subkey, value, 0.0))
    expect(isinstance(accepted, bool), f"the validator answered a non-bool\n{accepted!r}")
    kind = FIELDS.get(field)
    if accepted and kind is not None:
        _parse(kind, MSGPackSerializer.loads(value))  # what swarm/dht/node.py does with it
    return f"validator {'accepted' if accepted else 'rejected'}"


def check_record(case: tuple) -> str:
    if case[0] == "parse":
        return _parse(case[1], case[2])
    return _validate(*case[1:])


def derive_record(case: tuple, rng: random.Random) -> tuple | None:
    if case[0] != "validator":
        return None
    _, field, subkey, value = case
    if rng.random() < 0.25:
        return ("validator", field, fs.derive_bytes(subkey, rng), value)
    return ("validator", field, subkey, fs.derive_bytes(value, rng))


def record_corpus() -> list:
    dumps = MSGPackSerializer.dumps
    return [
        ("parse", "peer", {1: "x"}),  # keys that are not strings
        ("parse", "peer", {**VALID["peer"], "throughput": math.nan}),
        ("validator", "stage_0", dumps([1, 2]), dumps(VALID["peer"])),  # an unhashable subkey
        ("validator", "stage_0", dumps(b"owner"), b"\x91" * 5000 + b"\x90"),  # deep msgpack
    ]


TARGETS = (
    Target("records", record_cases, check_record, weight=18, corpus=record_corpus, fanout=3, derive=derive_record),
)
