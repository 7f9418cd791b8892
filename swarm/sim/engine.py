"""Discrete-event simulation of a swarm, driving the real wiring (swarm.policy.wiring) and rebalancing
(swarm.policy.rebalance) code with simulated peers, so that their behaviour at 10..10,000 peers can be measured
without machines.

Model, in short (docs/SIMULATOR.md has the details): peers serve one stage each, FIFO, one task at a
time; trainers keep microbatches in flight, each going forward over stages 0..S-2, forward+backward on
the last stage, then backward S-2..0; a hop is a transfer (pure delay), queueing and compute. Peers are
preempted (Poisson) and new ones join. A preempted peer's tasks are lost; the trainer notices after
`failure_timeout`, bans the peer (Wiring.on_failure) and re-sends the hop to another peer of the stage.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import math
import random
import time

from swarm.policy.rebalance import best_assignment_throughput, join_stage
from swarm.policy.wiring import PeerLoad, Wiring
from swarm.sim.churn import Churn
from swarm.sim.config import SECONDS_PER_HOUR, RunResult, SimConfig
from swarm.sim.entities import (
    ARRIVE,
    DEAD,
    DONE,
    DRAINING,
    FAIL,
    JOIN,
    NO_EXCLUDE,
    ONLINE,
    POLL,
    PREEMPT,
    READY,
    REBALANCE,
    REMOVE,
    TICK,
    Microbatch,
    Peer,
    Task,
)
from swarm.sim.summary import summarize

logger = logging.getLogger(__name__)

POLL_PERIOD = 1.0  # seconds between retries of hops that found no usable peer in their stage
RANDOM_PICK_TRIES = 16


class Simulator(Churn):
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg = cfg.resolved()
        S, K = cfg.stages, cfg.trainers
        base = cfg.seed * 1_000_003
        # separate streams, so that every policy sees the same peers, preemptions and joins
        self.pop_rng = random.Random(base + 1)
        self.churn_rng = random.Random(base + 2)
        self.stage_rng = random.Random(base + 3)
        self.rebalance_rng = random.Random(base + 4)
        self.mb_rng = random.Random(base + 5)
        self.route_rng = random.Random(base + 6)
        self.wiring = Wiring(random.Random(base + 7))
        self.jitter_rng = random.Random(base + 8)
        self.jitter_mu = -(cfg.compute_jitter**2) / 2  # mean 1
        self.now = 0.0
        self.heap: list[tuple[float, int, int, object]] = []
        self.seq = itertools.count()
        self.b = float(cfg.microbatch_samples)
        self.hop_stage = [h if h < S else 2 * S - 2 - h for h in range(2 * S - 1)]
        self.hop_work = [
            self.b / 3 if h < S - 1 else (self.b if h == S - 1 else 2 * self.b / 3) for h in range(2 * S - 1)
        ]
        self.hop_bytes = self.b * cfg.activation_kb * 1024
        self.trainer_lat = cfg.latency_median_ms / 1000
        self.views: list[list[list[PeerLoad]]] = [[[] for _ in range(S)] for _ in range(K)]
        self.views_version = 0  # bumped whenever a view list changes (invalidates cum_weights)
        self.cum_weights: dict[int, tuple[int, list[float]]] = {}
        self.by_id: dict[str, Peer] = {}
        self.alive: list[Peer] = []
        self.next_idx = 0
        self.waiting: list[list[Microbatch]] = [[] for _ in range(S)]
        self.poll_pending = [False] * S
        self.failing: set[Task] = set()
        # counters
        self.hops = self.retries = self.preemptions = self.joins = self.moves = self.rounds = self.completed = 0
        self.useful_compute = self.wasted_compute = 0.0
        self.trips: list[tuple[float, float]] = []  # (finished at, latency) of whole trips
        self.n_windows = max(1, math.ceil(cfg.sim_seconds / cfg.window - 1e-9))
        self.done_samples = [0.0] * self.n_windows
        self.ideal: list[float] = []
        self.assignment: list[float] = []
        self._init_peers()
        self._init_microbatches()

    # ---- setup ----

    def _new_peer(self) -> Peer:
        cfg, rng = self.cfg, self.pop_rng
        thr = rng.lognormvariate(math.log(cfg.throughput_median), cfg.throughput_sigma)
        bw = rng.lognormvariate(math.log(cfg.bandwidth_median_mbps * 1e6 / 8), cfg.bandwidth_sigma)
        lat = rng.lognormvariate(math.log(cfg.latency_median_ms / 1000), cfg.latency_sigma)
        peer = Peer(self.next_idx, thr, bw, lat, cfg.trainers)
        self.next_idx += 1
        self.by_id[peer.pid] = peer
        self.alive.append(peer)
        return peer

    def _join_choice(self) -> int:
        """A joining peer's stage: join_stage with rebalancing on (as real peers do), random otherwise."""
        if self.cfg.rebalance:
            return join_stage(self._stage_totals(), self.stage_rng)
        return self.stage_rng.randrange(self.cfg.stages)

    def _init_peers(self) -> None:
        """The peers present at t=0, placed by `initial` ("join": one by one, as later joiners are)."""
        cfg, S = self.cfg, self.cfg.stages
        totals = [0.0] * S
        peers: list[Peer] = []
        for i in range(cfg.peers):
            p = self._new_peer()
            if cfg.initial == "join" and cfg.rebalance:
                p.stage = join_stage(totals, self.stage_rng)
            elif cfg.initial in ("join", "random"):
                p.stage = self.stage_rng.randrange(S)
            elif cfg.initial == "skewed":  # one peer on every stage, all the others on stage 0
                p.stage = i if i < S else 0
            totals[p.stage] += p.thr
            peers.append(p)
        if cfg.initial == "balanced":  # largest first onto the weakest stage: a near-optimal layout
            totals = [0.0] * S
            for p in sorted(peers, key=lambda q: -q.thr):
                p.stage = join_stage(totals, self.stage_rng)
                totals[p.stage] += p.thr
        for p in peers:
            p.dst = p.stage
            self._go_online(p, placed_at=-math.inf)
        if cfg.preemption_rate > 0:
            self._schedule_preemption()
        if cfg.join_rate > 0:
            self._push(self.churn_rng.expovariate(cfg.join_rate * cfg.peers / SECONDS_PER_HOUR), JOIN, None)
        if cfg.rebalance:
            self._push(cfg.rebalance_period * self.rebalance_rng.uniform(0.7, 1.3), REBALANCE, None)
        self._push(cfg.window, TICK, 0)

    def _init_microbatches(self) -> None:
        """Spread over the pipeline, as in steady state, rather than all at stage 0 (a long warm-up)."""
        cfg, H = self.cfg, 2 * self.cfg.stages - 1
        total = sum(self.hop_work)
        hops = range(H)
        for i in range(cfg.in_flight):
            # where a microbatch spends its time: on the hops that take longest (backward, last stage)
            hop = self.mb_rng.choices(hops, weights=self.hop_work)[0]
            mb = Microbatch(i, i % cfg.trainers, hop, 0.0, credit=sum(self.hop_work[hop:]) / total)
            if mb.hop > 0:
                mb.sender = self.mb_rng.choice(self.alive)  # some peer held its activations
            self._send(mb)

    # ---- events ----

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), kind, obj))

    def run(self) -> RunResult:
        started, cpu = time.perf_counter(), time.process_time()
        end = self.cfg.sim_seconds
        heap, pop = self.heap, heapq.heappop
        handlers = {
            ARRIVE: self._arrive,
            DONE: self._done,
            FAIL: self._fail,
            POLL: self._poll,
            PREEMPT: self._preempt,
            JOIN: self._join,
            READY: self._ready,
            REMOVE: self._remove,
            REBALANCE: self._rebalance,
            TICK: self._tick,
        }
        while heap:
            t, _, kind, obj = pop(heap)
            if t > end:
                break
            self.now = t
            handlers[kind](obj)
        self.now = end
        while len(self.ideal) < self.n_windows:  # a run whose last tick fell just past the end
            self._record_window()
        return summarize(self, time.perf_counter() - started, time.process_time() - cpu)

    # ---- microbatches ----

    def _send(self, mb: Microbatch) -> None:
        """Route the microbatch's next hop to a peer of its stage (the policy under test)."""
        now, stage, work = self.now, self.hop_stage[mb.hop], self.hop_work[mb.hop]
        view = self.views[mb.trainer][stage]
        load = self._pick(view, work, mb.exclude)
        if load is None and mb.exclude:  # every candidate was tried: give the unbanned ones another go
            mb.exclude = NO_EXCLUDE
            load = self._pick(view, work, NO_EXCLUDE)
        if load is None:
            self.waiting[stage].append(mb)
            if not self.poll_pending[stage]:
                self.poll_pending[stage] = True
                self._push(now + POLL_PERIOD, POLL, stage)
            return
        peer = self.by_id[load.peer_id]
        load.in_flight += work
        task = Task(mb, peer, load, work)
        if peer.state == DEAD:  # still in the trainer's view: the call times out
            self.failing.add(task)
            self._push(now + self.cfg.failure_timeout, FAIL, task)
            return
        src = mb.sender
        if src is None:
            delay = self.trainer_lat + peer.lat + self.hop_bytes / peer.bw
        else:
            delay = src.lat + peer.lat + self.hop_bytes / min(src.bw, peer.bw)
        peer.transit[task] = None
        self._push(now + delay, ARRIVE, task)

    def _pick(self, view: list[PeerLoad], work: float, exclude: frozenset[str]) -> PeerLoad | None:
        if self.cfg.policy == "ours":
            return self.wiring.choose(view, work, self.now, exclude)
        return self._pick_random(view, exclude)

    def _pick_random(self, view: list[PeerLoad], exclude: frozenset[str]) -> PeerLoad | None:
        """uniform / weighted: a random eligible peer (Wiring.eligible's rule), by rejection sampling
        from the whole view, which is exact and O(log n) instead of O(n) per hop."""
        now, rng = self.now, self.route_rng
        if self.cfg.policy == "weighted":
            key = id(view)
            cached = self.cum_weights.get(key)
            if cached is None or cached[0] != self.views_version:
                cached = (self.views_version, list(itertools.accumulate(p.throughput for p in view)))
                self.cum_weights[key] = cached
            cum = cached[1]
        for _ in range(RANDOM_PICK_TRIES if view else 0):
            if self.cfg.policy == "weighted":
                p = view[min(len(view) - 1, bisect.bisect(cum, rng.random() * cum[-1]))]
            else:
                p = view[rng.randrange(len(view))]
            if p.online and p.banned_until <= now and p.peer_id not in exclude:
                return p
        eligible = self.wiring.eligible(view, now, exclude)  # most of the view is ineligible: do it the slow way
        if not eligible:
            return None
        if self.cfg.policy == "uniform":
            return rng.choice(eligible)
        return rng.choices(eligible, weights=[p.throughput for p in eligible])[0]

    def _arrive(self, task: Task) -> None:
        if task.lost:
            return
        peer = task.peer
        del peer.transit[task]
        if peer.running is None:
            self._start(peer, task)
        else:
            peer.queue.append(task)
            self._set_queue(peer, peer.queued_work + task.work)

    def _start(self, peer: Peer, task: Task) -> None:
        peer.running, peer.run_start = task, self.now
        if self.cfg.report_running:
            self._set_queue(peer, peer.queued_work)
        jitter = self.jitter_rng.lognormvariate(self.jitter_mu, self.cfg.compute_jitter)
        self._push(self.now + jitter * task.work / peer.thr, DONE, task)

    def _set_queue(self, peer: Peer, queued: float) -> None:
        """The peer's queue as the trainers see it (they poll peers' Info several times a second). Like
        the real executor's queue_length it leaves out the task being computed, unless report_running."""
        peer.queued_work = queued
        if self.cfg.report_running and peer.running is not None:
            queued += peer.running.work
        for load in peer.loads:
            load.reported_queue = queued

    def _done(self, task: Task) -> None:
        if task.lost:
            return
        peer, mb = task.peer, task.mb
        peer.running = None
        if self.cfg.report_running:
            self._set_queue(peer, peer.queued_work)
        self.hops += 1
        self.useful_compute += self.now - peer.run_start
        task.load.in_flight -= task.work
        Wiring.on_success(task.load)
        mb.hop += 1
        mb.sender = peer
        mb.exclude = NO_EXCLUDE
        if mb.hop == len(self.hop_stage):
            self._complete(mb)
        else:
            self._send(mb)
        if peer.queue:
            nxt = peer.queue.popleft()
            self._set_queue(peer, max(0.0, peer.queued_work - nxt.work))
            self._start(peer, nxt)
        elif peer.state == DRAINING:
            self._maybe_finish_drain(peer)

    def _complete(self, mb: Microbatch) -> None:
        now = self.now
        self.completed += 1
        # a microbatch that started mid-way counts for the work it did here, not for a whole one
        self.done_samples[min(self.n_windows - 1, int(now / self.cfg.window))] += self.b * mb.credit
        if mb.credit == 1.0:
            self.trips.append((now, now - mb.t0))
        mb.hop, mb.t0, mb.credit, mb.sender = 0, now, 1.0, None  # the trainer starts its next microbatch
        self._send(mb)

    def _fail(self, task: Task) -> None:
        """The trainer notices the failed call: ban the peer, re-send the hop elsewhere."""
        self.failing.discard(task)
        mb = task.mb
        task.load.in_flight -= task.work
        self.wiring.on_failure(task.load, self.now)
        self.retries += 1
        mb.exclude = mb.exclude | {task.peer.pid}
        self._send(mb)

    def _poll(self, stage: int) -> None:
        self.poll_pending[stage] = False
        waiting, self.waiting[stage] = self.waiting[stage], []
        for mb in waiting:
            self._send(mb)

    # ---- peers ----

    def _go_online(self, peer: Peer, placed_at: float) -> None:
        peer.state, peer.placed_at = ONLINE, placed_at
        for t, load in enumerate(peer.loads):
            load.stage, load.online, load.in_flight, load.reported_queue = peer.stage, True, 0.0, 0.0
            self.views[t][peer.stage].append(load)
        self.views_version += 1
        if self.waiting[peer.stage] and not self.poll_pending[peer.stage]:
            self.poll_pending[peer.stage] = True
            self._push(self.now, POLL, peer.stage)

    def _ready(self, peer: Peer) -> None:
        if peer.state != DEAD:
            self._go_online(peer, self.now)

    # ---- metrics ----

    def _tick(self, k: int) -> None:
        self._record_window()
        if k + 1 < self.n_windows:
            self._push(min(self.cfg.sim_seconds, (k + 2) * self.cfg.window), TICK, k + 1)

    def _record_window(self) -> None:
        S = self.cfg.stages
        self.ideal.append(best_assignment_throughput([p.thr for p in self.alive], S))
        serving = [0.0] * S
        for p in self.alive:
            if p.state in (ONLINE, DRAINING):
                serving[p.stage] += p.thr
        self.assignment.append(min(serving))

    def unaccounted_microbatches(self) -> int:
        """Microbatches that are neither in flight, nor waiting, nor about to be retried (must be 0)."""
        seen: set[int] = set()
        for p in self.alive:
            for task in itertools.chain(p.queue, p.transit, [p.running] if p.running else []):
                seen.add(task.mb.mid)
        for task in self.failing:
            seen.add(task.mb.mid)
        for waiting in self.waiting:
            seen.update(mb.mid for mb in waiting)
        return self.cfg.in_flight - len(seen)


def run_sim(cfg: SimConfig) -> RunResult:
    """Run one configuration (a top-level function, so that process pools can call it)."""
    return Simulator(cfg).run()
