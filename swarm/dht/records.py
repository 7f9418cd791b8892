"""The schema of the swarm's DHT records: what a peer announces under its stage's key, its recent
events, the run config. hivemind's SchemaValidator checks every stored value against `SwarmSchema`
on every node (written against pydantic's v1 API, as hivemind is)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pydantic.v1 as pydantic
from pydantic.v1.error_wrappers import ErrorWrapper

from swarm.core.states import PeerState

MAX_STAGES = 64
_Cert = pydantic.constr(strict=True, max_length=2000)


class _Record(pydantic.BaseModel):
    @classmethod
    def parse_obj(cls, obj):
        """pydantic's, but a dict with keys that are not strings (msgpack carries any) is a
        ValidationError too, not the TypeError of `cls(**obj)`: readers catch ValidationError."""
        try:
            return super().parse_obj(obj)
        except TypeError as e:
            raise pydantic.ValidationError([ErrorWrapper(e, loc="__root__")], cls) from None


class PeerRecord(_Record):
    """What a peer announces about itself under its stage's key (strict types: no conversions)."""

    peer_id: pydantic.constr(strict=True, max_length=80)
    state: Literal[tuple(s.value for s in PeerState)]  # type: ignore[valid-type]
    address: pydantic.constr(strict=True, max_length=200)
    throughput: pydantic.confloat(strict=True, ge=0.0)
    queue: pydantic.conint(strict=True, ge=0)
    step: pydantic.conint(strict=True, ge=0)
    version: pydantic.constr(strict=True, max_length=40)
    device: pydantic.constr(strict=True, max_length=40) = "cpu"
    cert: _Cert | None = None  # a private swarm's membership certificate (swarm.core.auth)

    class Config:
        extra = pydantic.Extra.forbid

    @pydantic.validator("state", pre=True)
    def _plain_state(cls, value):  # noqa: N805 - pydantic's validator signature
        """Store the state's plain string: records travel through msgpack, which knows no enums."""
        return value.value if isinstance(value, PeerState) else value


MAX_EVENTS_PER_PEER = 16
# Events that come often and routinely (a checkpoint every step, with --checkpoint-every 1): every
# window of recent events keeps only a few of them, so that they never push out the ones that matter
# (moves, joins, fallbacks).
ROUTINE_EVENTS = frozenset({"checkpoint"})


def _newest(items: list, n: int) -> list:
    return items[max(len(items) - n, 0) :] if n > 0 else []


def newest_events(events: list[dict], limit: int, routine_limit: int | None = None) -> list[dict]:
    """The newest `limit` events, oldest first: routine ones only in the places the others leave,
    and at most `routine_limit` of them."""

    def when(e: dict) -> float:
        t = e.get("time")
        return float(t) if isinstance(t, int | float) else 0.0

    ordered = sorted(events, key=when)
    notable = _newest([e for e in ordered if e.get("event") not in ROUTINE_EVENTS], limit)
    room = limit - len(notable) if routine_limit is None else min(routine_limit, limit - len(notable))
    routine = _newest([e for e in ordered if e.get("event") in ROUTINE_EVENTS], room)
    return sorted(notable + routine, key=when)


class EventRecord(_Record):
    events: pydantic.conlist(pydantic.constr(strict=True, max_length=400), max_items=MAX_EVENTS_PER_PEER)
    cert: _Cert | None = None

    class Config:
        extra = pydantic.Extra.forbid


class TrainerRecord(_Record):
    """What a trainer publishes about its training (for dashboards), refreshed every few seconds."""

    trainer_id: pydantic.constr(strict=True, max_length=40)
    step: pydantic.conint(strict=True, ge=0)
    loss: pydantic.confloat(strict=True) | None = None
    val_loss: pydantic.confloat(strict=True) | None = None
    samples_per_s: pydantic.confloat(strict=True, ge=0.0) = 0.0
    in_flight: pydantic.conint(strict=True, ge=0) = 0
    retries: pydantic.conint(strict=True, ge=0) = 0
    replays: pydantic.conint(strict=True, ge=0) = 0
    samples: pydantic.conint(strict=True, ge=0) = 0
    # failed calls per peer (the last 12 characters of its id), the peers with the most
    failed_peers: pydantic.conlist(
        pydantic.conlist(pydantic.constr(strict=True, max_length=16) | pydantic.conint(strict=True, ge=0)),
        max_items=16,
    ) = []
    time: pydantic.confloat(strict=True, ge=0.0) = 0.0
    cert: _Cert | None = None

    class Config:
        extra = pydantic.Extra.forbid


_Digest = pydantic.constr(strict=True, max_length=64)


class Accusation(pydantic.BaseModel):
    """A trainer's evidence that a peer answered differently from its stage-mates (swarm.trainer.honesty):
    the digests of the input, the accused's answer and the majority's, and the mates that agreed."""

    accused: pydantic.constr(strict=True, max_length=80)
    stage: pydantic.conint(strict=True, ge=0, lt=MAX_STAGES)
    step: pydantic.conint(strict=True, ge=0)
    kind: Literal["forward", "backward"]
    input_digest: _Digest
    accused_digest: _Digest
    majority_digest: _Digest
    error: pydantic.confloat(strict=True, ge=0.0)  # relative difference from the majority's answer
    witnesses: pydantic.conlist(pydantic.constr(strict=True, max_length=80), max_items=4)
    time: pydantic.confloat(strict=True, ge=0.0)

    class Config:
        extra = pydantic.Extra.forbid


class AccusationRecord(_Record):
    """One trainer's accusations (its subkey under the run's `accusations` key)."""

    trainer_id: pydantic.constr(strict=True, max_length=40)
    accusations: pydantic.conlist(Accusation, max_items=16)
    cert: _Cert | None = None

    class Config:
        extra = pydantic.Extra.forbid


_OwnerKey = pydantic.conbytes(strict=True, max_length=1024)
_schema_fields: dict = {f"stage_{k}": (dict[_OwnerKey, PeerRecord] | None, None) for k in range(MAX_STAGES)}
_schema_fields["config"] = (dict[_OwnerKey, pydantic.constr(strict=True, max_length=4000)] | None, None)
_schema_fields["events"] = (dict[_OwnerKey, EventRecord] | None, None)
_schema_fields["trainers"] = (dict[_OwnerKey, TrainerRecord] | None, None)
_schema_fields["accusations"] = (dict[_OwnerKey, AccusationRecord] | None, None)
# hivemind's SchemaValidator is written against pydantic's v1 API (pydantic.v1 under pydantic 2).
SwarmSchema = pydantic.create_model("SwarmSchema", __module__=__name__, **_schema_fields)


@dataclass(frozen=True)
class PeerEntry:
    owner: bytes
    record: PeerRecord
    expiration: float
