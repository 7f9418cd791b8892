"""What feeds the dashboard: the `StateSource` protocol, the state document's shape, and helpers.

The state document (what `GET /api/v1/state` returns) is a plain JSON-able dict:

    run          the run config ("run_id", "model", "num_stages", "sync", "codec", "security", ...)
    time         the snapshot's wall-clock time (unix seconds); elapsed_s: since the run started
    dht_ok       False when the collector cannot reach the DHT
    step, samples_per_s, bottleneck (stage index or None), healthy (every stage has a live peer)
    stages       [{"stage", "throughput", "live_peers", "peers": [{"peer_id", "state", "throughput",
                 "queue", "step", "last_seen_s", "address", "uptime_s", "samples_processed",
                 "failures", "moves", "device"}]}]
    trainers     [{"trainer_id", "step", "loss", "val_loss", "samples_per_s", "in_flight", "retries",
                 "replays", "last_seen_s"}]
    events       [{"time", "kind", "peer_id", "detail"}]   (kinds: EVENT_KINDS, others allowed)
    events_total {kind: count}   events seen since the dashboard started
    history      parallel lists, newest last, <= ~2000 points: "time", "step", "loss", "val_loss"
                 (entries may be null), "samples_per_s", "peers_per_stage" (a list per point)

A source may add keys; the dashboard passes them through. `source_error` is added by the app.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Protocol, runtime_checkable

from swarm.core.states import PeerState

logger = logging.getLogger(__name__)

# a peer's state on the page: its own (swarm.core.states.PeerState), or dead: listed as serving but
# no longer answering Info
DEAD = "dead"
ACCUSED = "accused"  # a trainer caught it lying (swarm.trainer.honesty): no work, no part in updates
PEER_STATES = (*(s.value for s in PeerState), DEAD, ACCUSED)
LIVE_STATES = tuple(s.value for s in PeerState if s.serving)
EVENT_KINDS = ("join", "leave", "move", "failure", "ban", "averaging_failed", "checkpoint")
HISTORY_KEYS = ("time", "step", "loss", "val_loss", "samples_per_s", "peers_per_stage")
REQUIRED_KEYS = (
    "run",
    "time",
    "elapsed_s",
    "dht_ok",
    "step",
    "samples_per_s",
    "bottleneck",
    "healthy",
    "stages",
    "trainers",
    "events",
    "events_total",
    "history",
)


@runtime_checkable
class StateSource(Protocol):
    """Anything that can produce the current state document; `snapshot` may raise (the app keeps the
    last good document and reports the error)."""

    async def snapshot(self) -> dict: ...


class StaticSource:
    """A source that always answers the same document (tests, `--from-json` style replays)."""

    def __init__(self, doc: dict) -> None:
        self.doc = doc

    async def snapshot(self) -> dict:
        return self.doc


def empty_state(num_stages: int = 0) -> dict:
    """A valid document with nothing in it (before the first good snapshot)."""
    return {
        "run": {"run_id": "", "model": "", "num_stages": num_stages, "sync": "", "codec": "", "security": ""},
        "time": 0.0,
        "elapsed_s": 0.0,
        "dht_ok": False,
        "step": 0,
        "samples_per_s": 0.0,
        "bottleneck": None,
        "healthy": False,
        "stages": [{"stage": k, "throughput": 0.0, "live_peers": 0, "peers": []} for k in range(num_stages)],
        "trainers": [],
        "events": [],
        "events_total": {},
        "history": {key: [] for key in HISTORY_KEYS},
    }


def check_state(doc: Any) -> None:
    """Raise ValueError when `doc` is not a state document (the app then treats it as a source error)."""
    if not isinstance(doc, dict):
        raise ValueError(f"state document must be a dict, got {type(doc).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in doc]
    if missing:
        raise ValueError(f"state document lacks {', '.join(missing)}")
    if not isinstance(doc["stages"], list) or not all(isinstance(s, dict) for s in doc["stages"]):
        raise ValueError("state document's 'stages' must be a list of objects")
    if not isinstance(doc["history"], dict):
        raise ValueError("state document's 'history' must be an object")


def finite(value: Any) -> Any:
    """`value` with every NaN/inf float replaced by None (browsers cannot parse NaN in JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def latest(values: list | None) -> float | None:
    """The newest non-null entry of a history list."""
    for value in reversed(values or []):
        if value is not None:
            return value
    return None


def current_losses(doc: dict) -> tuple[float | None, float | None]:
    """(train loss, validation loss) now: the mean over trainers that report one, else the newest
    non-null history entry."""
    result = []
    for key in ("loss", "val_loss"):
        values = [t[key] for t in doc.get("trainers") or [] if isinstance(t.get(key), int | float)]
        values = [v for v in values if math.isfinite(v)]
        result.append(sum(values) / len(values) if values else latest((doc.get("history") or {}).get(key)))
    return result[0], result[1]
