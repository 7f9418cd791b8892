"""The dashboard's live source: the state document of a running swarm, from the DHT alone (stage
records, the peers' events, the trainers' metrics records, the run config) and the peers' Info.

Info polls are rate-limited (each peer at most once per refresh, `concurrency` at a time, each with
a deadline), so a dashboard never loads the swarm: a trainer polls every peer ten times as often.
The collector adds what it observes itself: a peer that stopped answering ("dead"), a trainer's
failed calls to a peer ("ban"), and keeps the history of the run for the plots."""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.core.states import PeerState
from swarm.dashboard.source import ACCUSED, DEAD, HISTORY_KEYS
from swarm.dht.node import SwarmDHT
from swarm.dht.records import ROUTINE_EVENTS, TrainerRecord
from swarm.training.config import RunConfig
from swarm.wire.pool import ClientPool

logger = logging.getLogger(__name__)

DHT_REFRESH_S = 2.0
INFO_CONCURRENCY = 32
GONE_SHOWN_S = 300.0  # an offline or dead peer keeps its card this long
MAX_EVENTS = 500
MAX_ROUTINE_EVENTS = 50  # routine events (checkpoints) kept besides, so that they never push out a move
MAX_HISTORY = 2000
TRAINER_STALE_S = 30.0


def _detail(event: dict) -> str:
    kind = event.get("event")
    if kind == "move":
        return f"stage {event.get('src')} -> {event.get('dst')}: {event.get('reason', '')}"
    fields = {k: v for k, v in event.items() if k not in ("time", "event", "peer")}
    return json.dumps(fields, separators=(", ", ": "))[:300]


def _model_name(spec: dict) -> str:
    kind = spec.get("kind", "?")
    if kind == "gpt":
        return f"gpt ({spec.get('n_layers')} layers, d={spec.get('d_model')})"
    return str(spec.get("factory", kind)) if kind == "custom" else str(kind)


SEEN_EVENTS_MAX = 65_536  # 16 events per peer on the DHT: room for 4,096 peers


class LiveSource:
    """A `StateSource` (swarm.dashboard.source) over a live swarm. Give it a DHT node created on a
    thread that outlives it (hivemind's DHT process dies with its creating thread)."""

    def __init__(self, dht: SwarmDHT, run: RunConfig, concurrency: int = INFO_CONCURRENCY) -> None:
        self.dht, self.run, self.concurrency = dht, run, concurrency
        self.clients = ClientPool()
        self.view = SwarmView(dht, run.num_stages, clients=self.clients, info_timeout_s=2.0)
        self.events: collections.deque[dict] = collections.deque(maxlen=MAX_EVENTS)  # newest first
        self.routine_events: collections.deque[dict] = collections.deque(maxlen=MAX_ROUTINE_EVENTS)
        self.events_total: collections.Counter[str] = collections.Counter()
        self.history: dict[str, list] = {k: [] for k in HISTORY_KEYS}
        # events already counted, oldest first; bounded: an event drops off the DHT (16 per peer, with a TTL)
        # long before SEEN_EVENTS_MAX newer ones push it out of here
        self._seen_events: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._accused: set[str] = set()
        self._dead: set[str] = set()
        self._failures: dict[tuple[str, str], int] = {}  # (trainer, peer suffix) -> failed calls
        self._last_dht = 0.0
        self._trainers: list[TrainerRecord] = []
        self.started = time.time()

    async def snapshot(self) -> dict:
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        if now - self._last_dht >= DHT_REFRESH_S:
            self._last_dht = now
            try:
                await self.view.refresh_dht()
                self._trainers = await loop.run_in_executor(None, self.dht.get_trainers)
                for raw in await loop.run_in_executor(None, self.dht.get_events):
                    self._add_peer_event(raw)
            except Exception as e:  # noqa: BLE001 - shown as "DHT unreachable", the page keeps working
                logger.warning("DHT read failed: %s", e)
                self.view.dht_ok = False
        await self.view.poll_info(None, concurrency=self.concurrency)
        return self._document(self._trainers)

    # ---- events ----

    def _event(self, t: float, kind: str, peer_id: str, detail: str) -> None:
        key = (round(t, 3), kind, peer_id)
        if key in self._seen_events:
            return
        self._seen_events[key] = None
        if len(self._seen_events) > SEEN_EVENTS_MAX:
            self._seen_events.popitem(last=False)
        kept = self.routine_events if kind in ROUTINE_EVENTS else self.events
        kept.appendleft({"time": t, "kind": kind, "peer_id": peer_id, "detail": detail})
        self.events_total[kind] += 1

    def _add_peer_event(self, raw: str) -> None:
        try:
            e = json.loads(raw)
        except ValueError:
            return
        if isinstance(e, dict) and isinstance(e.get("time"), int | float):
            self._event(float(e["time"]), str(e.get("event")), self._full_id(str(e.get("peer", ""))), _detail(e))

    def _full_id(self, suffix: str) -> str:
        return next((p for p in self.view.peers if suffix and p.endswith(suffix)), suffix)

    def _observe(self, s: PeerStatus, state: str) -> None:
        if state == ACCUSED and s.peer_id not in self._accused:
            self._accused.add(s.peer_id)
            a = self.view.accused[s.peer_id]
            self._event(a.time, "ban", s.peer_id, f"caught lying: its {a.kind} answer is {a.error:.3g} off its mates'")
        if state == DEAD and s.peer_id not in self._dead:
            self._dead.add(s.peer_id)
            self._event(time.time(), "failure", s.peer_id, f"stopped answering (stage {s.stage})")
        elif state != DEAD:
            self._dead.discard(s.peer_id)

    def _observe_trainers(self, trainers: list[TrainerRecord]) -> None:
        for t in trainers:
            for suffix, n in t.failed_peers:
                before = self._failures.get((t.trainer_id, str(suffix)), 0)
                if int(n) > before:
                    self._failures[(t.trainer_id, str(suffix))] = int(n)
                    peer = self._full_id(str(suffix))
                    self._event(time.time(), "ban", peer, f"trainer {t.trainer_id}: {n} failed call(s), banned a while")

    # ---- the document ----

    def _state(self, s: PeerStatus) -> str:
        if s.peer_id in self.view.accused:
            return ACCUSED
        if s.record_state.serving and not self.view.is_live(s):
            return DEAD
        return s.record_state.value

    def _peer(self, s: PeerStatus, now: float) -> dict:
        state = self._state(s)
        self._observe(s, state)
        failures = sum(n for (_, suffix), n in self._failures.items() if s.peer_id.endswith(suffix))
        moves = sum(1 for e in self.events if e["kind"] == "move" and e["peer_id"] == s.peer_id)
        return {
            "peer_id": s.peer_id,
            "state": state,
            "throughput": round(s.load.throughput, 3),
            "queue": int(s.load.reported_queue),
            "step": s.step,
            "last_seen_s": round(now - s.last_info_ok, 2) if s.last_info_ok else None,
            "address": s.load.address,
            "uptime_s": round(s.uptime_s, 1),
            "samples_processed": s.samples_processed,
            "failures": failures,
            "moves": moves,
            "device": s.device,
            "note": s.note,
        }

    def _stages(self, now: float) -> list[dict]:
        out = []
        for k in range(self.run.num_stages):
            peers = []
            for s in sorted(self.view.peers.values(), key=lambda s: s.peer_id):
                recent = s.last_info_ok and now - s.last_info_ok < GONE_SHOWN_S
                if s.stage == k and (s.record_state != PeerState.OFFLINE or recent):
                    peers.append(self._peer(s, now))
            live = [p for p in peers if p["state"] in (PeerState.ONLINE, PeerState.DRAINING)]
            throughput = sum(p["throughput"] for p in live if p["state"] == PeerState.ONLINE)
            out.append({"stage": k, "throughput": round(throughput, 3), "live_peers": len(live), "peers": peers})
        return out

    def _document(self, trainers: list[TrainerRecord]) -> dict:
        now, wall = time.monotonic(), time.time()
        self._observe_trainers(trainers)
        stages = self._stages(now)
        fresh = [t for t in trainers if wall - t.time < TRAINER_STALE_S]
        step = self.view.global_step()
        sps = sum(t.samples_per_s for t in fresh)
        losses = [t.loss for t in fresh if t.loss is not None]
        vals = [t.val_loss for t in fresh if t.val_loss is not None]
        self._record_history(wall, step, losses, vals, sps, stages)
        run = {**self.run.to_dict(), "model": _model_name(self.run.model), "model_spec": self.run.model}
        run["security"] = "private" if self.run.private else "open"
        uptime = max((s.uptime_s for s in self.view.peers.values()), default=0.0)
        return {
            "run": run,
            "time": wall,
            "elapsed_s": round(uptime or wall - self.started, 1),
            "dht_ok": self.view.dht_ok,
            "step": step or 0,
            "samples_per_s": round(sps, 3),
            "bottleneck": min(stages, key=lambda st: st["throughput"])["stage"] if stages else None,
            "healthy": all(st["live_peers"] > 0 for st in stages),
            "stages": stages,
            "trainers": [{**t.dict(), "last_seen_s": round(max(0.0, wall - t.time), 1)} for t in trainers],
            "events": sorted([*self.events, *self.routine_events], key=lambda e: -e["time"]),
            "events_total": dict(self.events_total),
            "history": {k: list(v) for k, v in self.history.items()},
        }

    def _record_history(self, wall, step, losses, vals, sps, stages) -> None:
        h = self.history
        if h["time"] and wall - h["time"][-1] < 1.0 and h["step"][-1] == (step or 0):
            return
        h["time"].append(wall)
        h["step"].append(step or 0)
        h["loss"].append(sum(losses) / len(losses) if losses else None)
        h["val_loss"].append(sum(vals) / len(vals) if vals else None)
        h["samples_per_s"].append(round(sps, 3))
        h["peers_per_stage"].append([st["live_peers"] for st in stages])
        if len(h["time"]) > MAX_HISTORY:
            for k in h:
                h[k] = h[k][::2]

    async def close(self) -> None:
        await self.clients.close()
