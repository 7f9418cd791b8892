"""The run config is pinned to the coordinator's key: signed, verified, chosen by fingerprint; a
custom model factory is imported only if this process's operator allowed it."""

import pytest

from swarm.cluster.runconfig import SignedConfig, check_model_allowed, choose
from swarm.core.errors import ConfigError
from swarm.core.keys import SigningKey, check_fingerprint, verify
from swarm.training.config import RunConfig


def test_a_key_signs_and_verifies_and_persists(tmp_path):
    key = SigningKey.load_or_create(tmp_path / "run.key")
    again = SigningKey.load_or_create(tmp_path / "run.key")
    assert again.fingerprint == key.fingerprint and check_fingerprint(key.fingerprint) == key.fingerprint
    assert oct((tmp_path / "run.key").stat().st_mode & 0o777) == "0o600"
    sig = key.sign(b"hello")
    assert verify(key.public, sig, b"hello") and not verify(key.public, sig, b"hellO")
    assert not verify(b"short", sig, b"hello")
    with pytest.raises(ConfigError):
        check_fingerprint("sha256:xyz")


def test_only_the_run_keys_config_is_taken():
    real, rogue = SigningKey.generate(), SigningKey.generate()
    mine = SignedConfig.sign(RunConfig(run_id="r1"), real)
    theirs = SignedConfig.sign(RunConfig(run_id="r1", global_batch=64), rogue)
    records = [theirs.to_text(), mine.to_text()]
    assert choose(records, real.fingerprint).run.global_batch == 32
    assert choose([theirs.to_text()], real.fingerprint) is None  # keep waiting for the real one
    with pytest.raises(ConfigError, match="--run-key"):
        choose(records, None)  # two signers and no key given: refuse to guess
    assert choose([mine.to_text()], None).run.run_id == "r1"


def test_a_tampered_or_unsigned_config_is_ignored():
    key = SigningKey.generate()
    signed = SignedConfig.sign(RunConfig(run_id="r1"), key)
    tampered = SignedConfig(
        signed.config_json.replace('"global_batch":32', '"global_batch":64'), key.public, signed.signature
    )
    assert not tampered.valid
    assert choose([tampered.to_text(), RunConfig(run_id="r1").to_json(), "garbage"], key.fingerprint) is None


def test_a_custom_factory_needs_the_operators_permission():
    run = RunConfig(run_id="r1", model={"kind": "custom", "factory": "os:system"}, num_stages=2)
    with pytest.raises(ConfigError, match="--allow-model os:system"):
        check_model_allowed(run, [])
    check_model_allowed(run, ["os:system"])
    check_model_allowed(RunConfig(run_id="r1"), [])  # built-in models need nothing
