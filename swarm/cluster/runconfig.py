"""Joining a run: its config, as the coordinator signed it.

The coordinator's run key identifies the run: the coordinator publishes the config in a signed
envelope and prints the key's fingerprint; peers, trainers and tools given `--run-key` accept only a
config signed by that key (a second coordinator publishing another config for the run changes
nothing). Without `--run-key` they accept the one signing key they find, and refuse to guess when
several keys signed configs. A config naming a custom model factory is accepted only if the reader's
own operator allowed that factory on its command line (`--allow-model`): the DHT never makes a peer
import code.

A wrong --run-id is told at once, not after the deadline: the DHT keeps a registry of the runs whose
config is published on it, and a run that stays absent from a non-empty registry for a few seconds is
not coming."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

from swarm.core.errors import ConfigError
from swarm.core.keys import SigningKey, b64, fingerprint, unb64, verify
from swarm.dht.node import SwarmDHT
from swarm.training.config import RunConfig

# A run missing from a registry that lists others for this long is a wrong run id (its coordinator
# publishes the config before it prints its multiaddrs, so a real run is there long before).
RUN_ABSENT_GRACE_S = 4.0

logger = logging.getLogger(__name__)

ENVELOPE_VERSION = 1


@dataclass(frozen=True)
class SignedConfig:
    config_json: str
    key: bytes  # the run key (Ed25519 public key, raw)
    signature: bytes

    @classmethod
    def sign(cls, run: RunConfig, key: SigningKey) -> SignedConfig:
        text = run.to_json()
        return cls(text, key.public, key.sign(text.encode()))

    def to_text(self) -> str:
        body = {"v": ENVELOPE_VERSION, "config": self.config_json, "key": b64(self.key), "sig": b64(self.signature)}
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_text(cls, text: str) -> SignedConfig:
        try:
            body = json.loads(text)
            if body.get("v") != ENVELOPE_VERSION:
                raise ValueError(f"envelope version {body.get('v')!r}")
            return cls(str(body["config"]), unb64(body["key"]), unb64(body["sig"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"a run config record is not a signed config: {e}") from None

    @property
    def valid(self) -> bool:
        return verify(self.key, self.signature, self.config_json.encode())

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.key)

    @property
    def run(self) -> RunConfig:
        try:
            return RunConfig.from_json(self.config_json)
        except (TypeError, ValueError) as e:
            raise ConfigError(
                f"the run config published for this run cannot be used here ({e}): "
                "run the same swarm version as the coordinator"
            ) from None


def choose(records: list[str], run_key: str | None) -> SignedConfig | None:
    """The config signed by the run key (or by the only key there is), None while there is none."""
    signed = []
    for text in records:
        try:
            s = SignedConfig.from_text(text)
        except ConfigError as e:
            logger.warning("%s", e)
            continue
        if s.valid:
            signed.append(s)
        else:
            logger.warning("ignoring a run config whose signature does not verify")
    if run_key is not None:
        mine = [s for s in signed if s.fingerprint == run_key]
        if len(mine) < len(signed):
            logger.warning("ignoring %d run config(s) signed by another key than %s", len(signed) - len(mine), run_key)
        return mine[0] if mine else None
    keys = {s.fingerprint for s in signed}
    if len(keys) > 1:
        raise ConfigError(
            f"run configs signed by {len(keys)} different keys ({', '.join(sorted(keys))}): give the coordinator's "
            "with --run-key (it prints it at start)"
        )
    return signed[0] if signed else None


def check_model_allowed(run: RunConfig, allowed: list[str] | tuple[str, ...]) -> None:
    factory = run.model.get("factory") if run.model.get("kind") == "custom" else None
    if factory is not None and factory not in allowed:
        raise ConfigError(
            f"the run's model is the custom factory {factory!r}, which this process does not allow: importing it "
            f"runs its code here; if you trust it, add --allow-model {factory}"
        )


def fetch_signed_config(
    dht: SwarmDHT,
    timeout_s: float,
    run_key: str | None = None,
    allowed_models: list[str] | tuple[str, ...] = (),
    absent_grace_s: float = RUN_ABSENT_GRACE_S,
) -> SignedConfig:
    """The run's signed config, polled with a growing delay (0.2 s to 2 s) until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    absent_since: float | None = None
    while True:
        found = choose(dht.get_config_records(), run_key)
        if found is not None:
            check_model_allowed(found.run, allowed_models)
            return found
        now = time.monotonic()
        runs = dht.get_runs()
        if runs and dht.run_id not in runs:
            absent_since = now if absent_since is None else absent_since
            if now - absent_since >= absent_grace_s:
                raise ConfigError(
                    f"run {dht.run_id!r} is not on this DHT, which has run(s) {', '.join(sorted(runs))}: "
                    "check --run-id (the coordinator prints it)"
                )
        else:
            absent_since = None
        if now > deadline:
            signed_by = f" signed by {run_key}" if run_key else ""
            raise ConfigError(
                f"no run config{signed_by} for run {dht.run_id!r} on the DHT after {timeout_s:.0f} s: is the "
                "coordinator up, and are --initial-peers, --run-id and --run-key right?"
            )
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)


def fetch_run_config(
    dht: SwarmDHT, timeout_s: float, run_key: str | None = None, allowed_models: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    return fetch_signed_config(dht, timeout_s, run_key, allowed_models).run
