"""The DHT validators remember the records they found valid (each read of a stage record returns
every entry, and the RSA check of each was most of a DHT process's CPU); tampered or unsigned-by-owner
records are still refused."""

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.node import _SignatureValidator


def _signed(validator: RSASignatureValidator, value: bytes) -> DHTRecord:
    record = DHTRecord(
        key=DHTID.generate(source="run_stage_0").to_bytes(),
        subkey=validator.local_public_key,
        value=value,
        expiration_time=get_dht_time() + 30,
    )
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def test_a_valid_record_is_checked_once_and_a_tampered_one_is_refused():
    owner = _SignatureValidator(RSAPrivateKey())
    reader = _SignatureValidator(RSAPrivateKey())
    record = _signed(owner, b"entry")
    checks = []
    parent_validate = RSASignatureValidator.validate

    def counting(self, rec):
        checks.append(rec)
        return parent_validate(self, rec)

    RSASignatureValidator.validate = counting
    try:
        assert reader.validate(record) and reader.validate(record) and reader.validate(record)
        assert len(checks) == 1  # remembered
        value = record.value.replace(b"entry", b"other")
        tampered = DHTRecord(record.key, record.subkey, value, record.expiration_time)
        assert not reader.validate(tampered) and not reader.validate(tampered)
        assert len(checks) == 3  # a refusal is not remembered: checked each time
    finally:
        RSASignatureValidator.validate = parent_validate
