"""Synthetic state documents: a realistic swarm (`synthetic_state`) and one that evolves in time
(`SyntheticSource`), for tests, demos and benchmarks of the dashboard. No network, no model."""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable

from swarm.core.states import PeerState
from swarm.dashboard.source import ACCUSED, DEAD, HISTORY_KEYS, LIVE_STATES

logger = logging.getLogger(__name__)

BASE_TIME = 1764770000.0
HISTORY_POINTS = 500
HISTORY_STEP_S = 2.0
MAX_HISTORY = 2000
MAX_EVENTS = 200
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_DEVICES = ("cuda:0 (A100 80GB)", "cuda:0 (RTX 3090)", "cuda:0 (T4)", "cpu")


def _loss_at(step: float, rng: random.Random, val: bool = False) -> float:
    base = 1.2 + 4.3 * math.exp(-step / 900.0) + (0.05 if val else 0.0)
    return round(base + rng.gauss(0.0, 0.03), 4)


def _peer(rng: random.Random, stage: int, state: str, step: int) -> dict:
    live = state in LIVE_STATES
    throughput = round(rng.uniform(8.0, 40.0), 2) if state != PeerState.JOINING else 0.0
    return {
        "peer_id": "12D3KooW" + "".join(rng.choice(_B58) for _ in range(44)),
        "state": state,
        "stage": stage,
        "throughput": throughput if state != PeerState.OFFLINE else 0.0,
        "queue": rng.randint(0, 8) if live else 0,
        "step": step if live else max(0, step - rng.randint(1, 200)),
        "last_seen_s": round(rng.uniform(0.0, 2.0) if state != DEAD else rng.uniform(10.0, 60.0), 2),
        "address": f"10.{rng.randint(0, 255)}.{rng.randint(0, 255)}.{rng.randint(1, 254)}:{rng.randint(30000, 60000)}",
        "uptime_s": round(rng.uniform(60.0, 20000.0), 1),
        "samples_processed": rng.randint(0, 400000),
        "failures": rng.choice((0, 0, 0, 0, 1, 2, 5)),
        "moves": rng.choice((0, 0, 0, 1, 1, 2, 3)),
        "device": rng.choice(_DEVICES),
    }


_STATE_ODDS = (
    (PeerState.JOINING, 0.03), (ACCUSED, 0.035), (PeerState.DRAINING, 0.065), (DEAD, 0.085), (PeerState.OFFLINE, 0.10),
)  # fmt: skip


def _pick_state(rng: random.Random) -> str:
    r = rng.random()
    return str(next((state for state, below in _STATE_ODDS if r < below), PeerState.ONLINE))


def _stage_sizes(peers: int, stages: int, thin: int) -> list[int]:
    """Peers per stage: stage `thin` gets about a tenth of the others' share (at least 2 when possible)."""
    weights = [0.1 if k == thin and stages > 1 else 1.0 for k in range(stages)]
    sizes = [int(peers * w / sum(weights)) for w in weights]
    if stages > 1:
        sizes[thin] = min(max(sizes[thin], 2), peers // stages)
    k = 0
    while sum(sizes) < peers:  # hand out the remainder to the thick stages
        if k % stages != thin or stages == 1:
            sizes[k % stages] += 1
        k += 1
    return sizes


def _make_stages(rng: random.Random, peers: int, stages: int, step: int) -> list[dict]:
    thin = stages // 2
    result = []
    for k, size in enumerate(_stage_sizes(peers, stages, thin)):
        states = [_pick_state(rng) for _ in range(size)]
        states[: min(2, size)] = [PeerState.ONLINE.value] * min(2, size)  # every stage served, the thin one barely
        result.append(
            {"stage": k, "throughput": 0.0, "live_peers": 0, "peers": [_peer(rng, k, s, step) for s in states]}
        )
    return result


def aggregate(doc: dict) -> None:
    """Recompute the derived fields (stage throughput and live peers, bottleneck, health) in place."""
    for stage in doc["stages"]:
        live = [p for p in stage["peers"] if p["state"] in LIVE_STATES]
        stage["live_peers"] = len(live)
        stage["throughput"] = round(sum(p["throughput"] for p in live), 2)
    stages = doc["stages"]
    doc["healthy"] = bool(stages) and all(s["live_peers"] > 0 for s in stages)
    doc["bottleneck"] = min(range(len(stages)), key=lambda k: stages[k]["throughput"]) if stages else None
    doc["samples_per_s"] = round(min((s["throughput"] for s in stages), default=0.0), 2)


def _history(rng: random.Random, doc: dict, points: int) -> dict:
    now, step, rate = doc["time"], doc["step"], doc["samples_per_s"]
    live = [s["live_peers"] for s in doc["stages"]]
    history: dict[str, list] = {key: [] for key in HISTORY_KEYS}
    for i in range(points):
        back = points - 1 - i
        point_step = max(0, int(step - back * HISTORY_STEP_S * rate / doc["run"]["global_batch"]))
        history["time"].append(round(now - back * HISTORY_STEP_S, 3))
        history["step"].append(point_step)
        history["loss"].append(_loss_at(point_step, rng) if i % 25 else None)
        history["val_loss"].append(_loss_at(point_step, rng, val=True) if i % 10 == 0 else None)
        history["samples_per_s"].append(round(max(0.0, rate * (0.8 + 0.2 * i / points) + rng.gauss(0, rate * 0.03)), 2))
        dip = [2.0 * back / points * (1.0 + math.sin(i / 25.0 + k)) for k in range(len(live))]
        history["peers_per_stage"].append([max(0, n - round(d)) for n, d in zip(live, dip, strict=True)])
    return history


def _event(rng: random.Random, when: float, doc: dict) -> dict:
    stages = len(doc["stages"])
    stage = doc["stages"][rng.randrange(stages)]
    peer = rng.choice(stage["peers"]) if stage["peers"] else None
    k = stage["stage"]
    kind = rng.choices(
        ("join", "leave", "move", "failure", "ban", "averaging_failed", "checkpoint"), (30, 15, 15, 15, 3, 10, 12)
    )[0]
    details = {
        "join": f"joined stage {k}",
        "leave": f"left stage {k} (drained)",
        "move": f"stage {(k + 1) % stages} -> {k}: stage {k} is the bottleneck",
        "failure": f"stage {k}: stopped answering ({rng.randint(1, 4)} microbatches retried)",
        "ban": f"stage {k}: banned after {rng.randint(3, 9)} failed requests",
        "averaging_failed": f"stage {k}: averaging round failed (timeout, {rng.randint(1, 3)} peers missing)",
        "checkpoint": f"checkpoint at step {max(0, doc['step'] - rng.randint(0, 2000))} saved",
    }
    peer_id = None if kind in ("averaging_failed", "checkpoint") or peer is None else peer["peer_id"]
    return {"time": round(when, 3), "kind": kind, "peer_id": peer_id, "detail": details[kind]}


def _trainers(rng: random.Random, doc: dict) -> list[dict]:
    step, rate = doc["step"], doc["samples_per_s"]
    return [
        {
            "trainer_id": f"t{i}-{rng.randrange(16**4):04x}",
            "step": step,
            "loss": _loss_at(step, rng),
            "val_loss": _loss_at(step, rng, val=True),
            "samples_per_s": round(rate / 4, 2),
            "in_flight": rng.randint(4, 16),
            "retries": rng.randint(0, 20),
            "replays": rng.randint(0, 5),
            "last_seen_s": round(rng.uniform(0.0, 2.0), 2),
        }
        for i in range(4)
    ]


def synthetic_state(peers: int = 1000, stages: int = 8, seed: int = 0, t: float = 0.0) -> dict:
    """A realistic state document: `peers` peers over `stages` stages (some joining, draining, offline
    or dead, the middle stage thin and the bottleneck), 500 history points, 200 events. `t` seconds
    after the reference time: the step grows and the loss falls with it."""
    rng = random.Random(seed)
    elapsed = HISTORY_POINTS * HISTORY_STEP_S + t
    run = {"run_id": f"synthetic-{seed}", "model": "gpt", "num_stages": stages, "sync": "async", "codec": "fp16"}
    run |= {"global_batch": 32, "security": "open", "lr": 3e-4, "optimizer": "adamw", "dataset": "synthetic"}
    doc = {"run": run, "time": BASE_TIME + t, "elapsed_s": elapsed, "dht_ok": True, "step": 0}
    doc["stages"] = _make_stages(rng, peers, stages, 0)
    aggregate(doc)
    doc["step"] = int(elapsed * doc["samples_per_s"] / run["global_batch"])
    for stage in doc["stages"]:
        for peer in stage["peers"]:
            peer["step"] = doc["step"] if peer["state"] in LIVE_STATES else max(0, doc["step"] - rng.randint(1, 200))
    doc["trainers"] = _trainers(rng, doc)
    doc["history"] = _history(rng, doc, HISTORY_POINTS)
    start = doc["time"] - (HISTORY_POINTS - 1) * HISTORY_STEP_S
    doc["events"] = sorted(
        (_event(rng, rng.uniform(start, doc["time"]), doc) for _ in range(MAX_EVENTS)), key=lambda e: e["time"]
    )
    totals: dict[str, int] = {}
    for event in doc["events"]:
        totals[event["kind"]] = totals.get(event["kind"], 0) + 1
    doc["events_total"] = totals
    return doc


def _copy_state(doc: dict) -> dict:
    """A copy deep enough that the caller may keep it while the source goes on mutating its own."""
    out = dict(doc)
    out["run"] = dict(doc["run"])
    out["stages"] = [{**s, "peers": [dict(p) for p in s["peers"]]} for s in doc["stages"]]
    out["trainers"] = [dict(t) for t in doc["trainers"]]
    out["events"] = list(doc["events"])
    out["events_total"] = dict(doc["events_total"])
    out["history"] = {key: list(values) for key, values in doc["history"].items()}
    return out


class SyntheticSource:
    """A synthetic swarm that evolves in (real) time: each snapshot advances it by the time since the
    last one (step grows, loss falls, joining peers come online, a peer dies now and then) and appends
    a history point. `kill(peer_id)` kills a peer now; setting `error` makes `snapshot` raise it, and
    `dht_ok = False` reports the DHT unreachable."""

    def __init__(
        self,
        peers: int = 1000,
        stages: int = 8,
        seed: int = 0,
        death_rate: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.death_rate = death_rate  # peer deaths per second, swarm-wide
        self.error: str | None = None  # when set, snapshot() raises RuntimeError(error)
        self.dht_ok = True  # reported as the document's dht_ok
        self._rng = random.Random(seed + 1)
        self._clock = clock
        self._lock = threading.Lock()
        self._doc = synthetic_state(peers, stages, seed)
        self._step = float(self._doc["step"])
        self._last = clock()
        self._dead_since: dict[str, float] = {}

    @property
    def peer_ids(self) -> list[str]:
        with self._lock:
            return [p["peer_id"] for s in self._doc["stages"] for p in s["peers"]]

    async def snapshot(self) -> dict:
        if self.error is not None:
            raise RuntimeError(self.error)
        with self._lock:
            now = self._clock()
            self._advance(max(0.0, now - self._last))
            self._last = now
            self._doc["dht_ok"] = self.dht_ok
            return _copy_state(self._doc)

    def kill(self, peer_id: str) -> None:
        """Turn the peer dead (its record still says online, it stopped answering) and log a failure."""
        with self._lock:
            for stage in self._doc["stages"]:
                for peer in stage["peers"]:
                    if peer["peer_id"] == peer_id:
                        self._kill(stage["stage"], peer, "killed")
                        aggregate(self._doc)
                        return
        raise KeyError(peer_id)

    def _kill(self, stage: int, peer: dict, why: str) -> None:
        peer["state"] = DEAD
        peer["queue"] = 0
        self._dead_since[peer["peer_id"]] = self._doc["time"]
        self._add_event("failure", peer["peer_id"], f"stage {stage}: stopped answering ({why})")

    def _add_event(self, kind: str, peer_id: str | None, detail: str) -> None:
        doc = self._doc
        doc["events"].append({"time": round(doc["time"], 3), "kind": kind, "peer_id": peer_id, "detail": detail})
        del doc["events"][:-MAX_EVENTS]
        doc["events_total"][kind] = doc["events_total"].get(kind, 0) + 1

    def _advance(self, dt: float) -> None:
        doc, rng = self._doc, self._rng
        doc["time"] += dt
        doc["elapsed_s"] += dt
        self._step += dt * doc["samples_per_s"] / doc["run"]["global_batch"]
        doc["step"] = int(self._step)
        self._update_peers(dt)
        if rng.random() < 1.0 - math.exp(-self.death_rate * dt):
            stage = rng.choice(doc["stages"])
            live = [p for p in stage["peers"] if p["state"] == PeerState.ONLINE]
            if len(live) > 1:  # never the last one: the demo stays healthy unless killed on purpose
                self._kill(stage["stage"], rng.choice(live), "crashed")
        aggregate(doc)
        for trainer in doc["trainers"]:
            trainer |= {
                "step": doc["step"],
                "loss": _loss_at(doc["step"], rng),
                "samples_per_s": doc["samples_per_s"] / 4,
            }
            trainer["val_loss"] = _loss_at(doc["step"], rng, val=True)
            trainer["last_seen_s"] = round(rng.uniform(0.0, 2.0), 2)
        self._append_history()

    def _update_peers(self, dt: float) -> None:
        doc, rng = self._doc, self._rng
        for stage in doc["stages"]:
            for peer in stage["peers"]:
                state = peer["state"]
                if state == PeerState.JOINING and rng.random() < 1.0 - math.exp(-dt / 20.0):
                    peer["state"], peer["throughput"] = PeerState.ONLINE.value, round(rng.uniform(8.0, 40.0), 2)
                    self._add_event("join", peer["peer_id"], f"joined stage {stage['stage']}")
                if peer["state"] in LIVE_STATES:
                    peer["step"] = doc["step"]
                    peer["uptime_s"] = round(peer["uptime_s"] + dt, 1)
                    peer["samples_processed"] += int(peer["throughput"] * dt)
                    peer["last_seen_s"] = round(rng.uniform(0.0, 2.0), 2)
                    peer["queue"] = rng.randint(0, 8)
                elif state == DEAD:
                    since = self._dead_since.get(peer["peer_id"], doc["time"] - peer["last_seen_s"])
                    peer["last_seen_s"] = round(doc["time"] - since, 2)
                elif state == PeerState.OFFLINE:
                    peer["last_seen_s"] = round(peer["last_seen_s"] + dt, 2)

    def _append_history(self) -> None:
        doc, history = self._doc, self._doc["history"]
        history["time"].append(round(doc["time"], 3))
        history["step"].append(doc["step"])
        history["loss"].append(_loss_at(doc["step"], self._rng))
        due = len(history["time"]) % 10 == 0
        history["val_loss"].append(_loss_at(doc["step"], self._rng, val=True) if due else None)
        history["samples_per_s"].append(doc["samples_per_s"])
        history["peers_per_stage"].append([s["live_peers"] for s in doc["stages"]])
        for values in history.values():
            del values[:-MAX_HISTORY]
