"""Discrete-event simulation of a swarm, driving the real wiring (swarm.policy.wiring), pacing
(swarm.policy.pacing) and rebalancing (swarm.policy.rebalance) code with simulated peers, so that their
behaviour at 10..10,000 peers can be measured without machines.

Model, in short (docs/SIMULATOR.md has the details): peers serve one stage each, FIFO, one task at a
time; trainers keep microbatches in flight, each going forward over stages 0..S-2, forward+backward on
the last stage, then backward S-2..0; a hop is a transfer (pure delay), queueing and compute. Stages
apply an update once they hold the global batch, after an all-reduce (swarm.sim.steps); Info polls and
DHT reads cost the peers CPU and bandwidth (swarm.sim.overheads). Peers are preempted (Poisson) and
new ones join. A preempted peer's tasks are lost; the trainer notices after `failure_timeout`, bans
the peer (Wiring.on_failure) and re-sends the hop to another peer of the stage.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import time

import numpy as np

from swarm.policy.rebalance import best_assignment_throughput
from swarm.policy.wiring import Wiring
from swarm.sim.churn import Churn
from swarm.sim.config import RunResult, SimConfig
from swarm.sim.entities import (
    ARRIVE,
    DEAD,
    DISCOVER,
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
    REPLAY,
    RETRY_UPDATE,
    SEEN,
    TICK,
    UPDATE,
    Microbatch,
    Peer,
    Task,
)
from swarm.sim.overheads import MIN_CPU_SHARE, MIN_LINK_SHARE, Overheads
from swarm.sim.population import Population
from swarm.sim.routing import Router, StageView, touch
from swarm.sim.steps import Steps
from swarm.sim.summary import summarize

logger = logging.getLogger(__name__)

POLL_PERIOD = 1.0  # seconds between retries of hops that found no usable peer in their stage
JITTER_BLOCK = 8192


class Simulator(Population, Churn, Steps, Overheads):
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
        self.wiring = Wiring(random.Random(base + 7))
        self.jitter_rng = np.random.default_rng(base + 8)
        self.jitters: list[float] = []
        self.sync_rng = random.Random(base + 9)
        self.replica_rng = random.Random(base + 10)
        self.jitter_mu = -(cfg.compute_jitter**2) / 2  # mean 1
        self.now = 0.0
        self.heap: list[tuple[float, int, object, object]] = []  # (time, seq, handler, its argument)
        self.seq = itertools.count()
        self.handlers = self._handlers()
        self.on_arrive, self.on_done = self._arrive, self._done
        self.report_running = cfg.report_running
        self.last_forward, self.trip_hops = S - 1, 2 * S - 1  # hops from last_forward on are backwards
        self.b = float(cfg.microbatch_samples)
        self.b_int = int(cfg.microbatch_samples)
        self.hop_stage = [h if h < S else 2 * S - 2 - h for h in range(2 * S - 1)]
        self.hop_unit = [1 / 3 if h < S - 1 else (1.0 if h == S - 1 else 2 / 3) for h in range(2 * S - 1)]
        self.sample_bytes = cfg.activation_kb * 1024
        self.trainer_lat = cfg.latency_median_ms / 1000
        views = [[StageView(k) for k in range(S)] for _ in range(K)]
        self.router = Router(cfg.policy, self.wiring, random.Random(base + 6), views)
        self.router.check = cfg.check_routing
        self.by_id: dict[str, Peer] = {}
        self.alive: list[Peer] = []  # in no particular order (preemptions pick by index)
        self.present: dict[Peer, None] = {}  # the same peers, in the order they came
        self.serving: list[dict[Peer, None]] = [{} for _ in range(S)]  # online or draining, in view order
        self.placed = [0.0] * S  # throughput per stage as placement counts it (movers at their destination)
        self.next_idx = 0
        self.draining = 0  # peers draining for a move (a rebalancing round waits for them)
        self.waiting: list[list[Microbatch]] = [[] for _ in range(S)]
        self.poll_pending = [False] * S
        self.failing: set[Task] = set()
        # counters
        self.hops = self.retries = self.preemptions = self.joins = self.moves = self.rounds_run = self.completed = 0
        self.useful_compute = self.wasted_compute = 0.0
        self.trips: list[tuple[float, float]] = []  # (finished at, latency) of whole trips
        self.n_windows = max(1, math.ceil(cfg.sim_seconds / cfg.window - 1e-9))
        self.done_samples = [0.0] * self.n_windows
        self.ideal: list[float] = []
        self.assignment: list[float] = []
        self.overhead_series: list[dict[str, float]] = []
        self._init_steps()
        self._init_overheads()
        self._init_peers()
        self._init_microbatches()

    # ---- events ----

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self.heap, (t, next(self.seq), self.handlers[kind], obj))

    def _handlers(self) -> dict:
        return {
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
            UPDATE: self._update,
            SEEN: self._seen,
            RETRY_UPDATE: self._retry_round,
            REPLAY: self._send,
            DISCOVER: self._discover,
        }

    def run(self) -> RunResult:
        started, cpu = time.perf_counter(), time.process_time()
        end = self.cfg.sim_seconds
        heap, pop = self.heap, heapq.heappop
        while heap:
            t, _, handler, obj = pop(heap)
            if t > end:
                break
            self.now = t
            handler(obj)
        self.now = end
        self._idle_change(0)
        while len(self.ideal) < self.n_windows:  # a run whose last tick fell just past the end
            self._record_window()
        return summarize(self, time.perf_counter() - started, time.process_time() - cpu)

    # ---- microbatches ----

    def _start_trip(self, mb: Microbatch) -> None:
        """The trainer starts the slot's next microbatch (its step tag and size are set)."""
        mb.hop, mb.t0, mb.sender, mb.exclude = 0, self.now, None, NO_EXCLUDE
        self._send(mb)

    def _send(self, mb: Microbatch) -> None:
        """Route the microbatch's next hop to a peer of its stage (the policy under test)."""
        now, stage, work = self.now, self.hop_stage[mb.hop], self.hop_unit[mb.hop] * mb.n
        router = self.router
        load = router.pick(mb.trainer, stage, work, now, mb.exclude)
        if load is None and mb.exclude:  # every candidate was tried: give the unbanned ones another go
            mb.exclude = NO_EXCLUDE
            load = router.pick(mb.trainer, stage, work, now, NO_EXCLUDE)
        if load is None:
            self.waiting[stage].append(mb)
            if not self.poll_pending[stage]:
                self.poll_pending[stage] = True
                self._push(now + POLL_PERIOD, POLL, stage)
            return
        peer = load.peer
        load.in_flight += work
        touch(load)
        task = Task(mb, peer, load, work)
        if peer.state == DEAD:  # still in the trainer's view: the call times out
            self.failing.add(task)
            self._push(now + self.cfg.failure_timeout, FAIL, task)
            return
        src, link_used = mb.sender, self.link_used
        bandwidth = peer.bw - link_used[peer.stage]  # Overheads._bandwidth, inlined for the common case
        if peer.replica_of or bandwidth < MIN_LINK_SHARE * peer.bw:
            bandwidth = self._bandwidth(peer)
        if src is None:
            delay = self.trainer_lat + peer.lat + mb.n * self.sample_bytes / bandwidth
        else:
            other = src.bw - link_used[src.stage]
            if src.replica_of or other < MIN_LINK_SHARE * src.bw:
                other = self._bandwidth(src)
            delay = src.lat + peer.lat + mb.n * self.sample_bytes / (bandwidth if bandwidth < other else other)
        peer.transit[task] = None
        heapq.heappush(self.heap, (now + delay, next(self.seq), self.on_arrive, task))

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
        if not self.jitters:  # lognormal factors of mean 1, drawn in blocks
            self.jitters = self.jitter_rng.lognormal(self.jitter_mu, self.cfg.compute_jitter, JITTER_BLOCK).tolist()
        share = self.cpu_free[peer.stage]  # Overheads._cpu_share, inlined for the common case
        if peer.replica_of or share < MIN_CPU_SHARE:
            share = self._cpu_share(peer)
        done = self.now + self.jitters.pop() * task.work / (peer.thr * share)
        heapq.heappush(self.heap, (done, next(self.seq), self.on_done, task))

    def _set_queue(self, peer: Peer, queued: float) -> None:
        """The peer's queue as the trainers see it (they poll peers' Info several times a second). Like
        the real executor's queue_length it leaves out the task being computed, unless report_running."""
        peer.queued_work = queued
        if self.report_running and peer.running is not None:
            queued += peer.running.work
        for load in peer.loads:
            load.reported_queue = queued
            touch(load)

    def _done(self, task: Task) -> None:
        if task.lost:
            return
        peer, mb, load = task.peer, task.mb, task.load
        peer.running = None
        if self.report_running:
            self._set_queue(peer, peer.queued_work)
        self.hops += 1
        self.useful_compute += self.now - peer.run_start
        load.in_flight -= task.work
        touch(load)
        Wiring.on_success(load)
        hop = mb.hop
        if hop >= self.last_forward:  # a backward: the stage now holds this gradient
            self._contribute(peer, mb.trainer, mb.tag, mb.n)
        if not mb.replay:
            mb.hop, mb.sender, mb.exclude = hop + 1, peer, NO_EXCLUDE
            if hop + 1 == self.trip_hops:
                self._complete(mb)
            else:
                self._send(mb)
        if peer.queue:
            nxt = peer.queue.popleft()
            queued = peer.queued_work - nxt.work
            self._set_queue(peer, queued if queued > 0.0 else 0.0)
            self._start(peer, nxt)
        elif peer.state == DRAINING:
            self._maybe_finish_drain(peer)

    def _complete(self, mb: Microbatch) -> None:
        now = self.now
        self.completed += 1
        self.done_samples[min(self.n_windows - 1, int(now / self.cfg.window))] += mb.n
        if mb.t0 >= 0.0:  # a whole trip in the run
            self.trips.append((now, now - mb.t0))
        self.pacers[mb.trainer].done(mb.tag, int(mb.n))
        if self._take(mb):  # the trainer starts its next microbatch, if the pacing lets it
            self._start_trip(mb)
        self._wake(mb.trainer)  # samples done may let held-back slots start

    def _fail(self, task: Task) -> None:
        """The trainer notices the failed call: ban the peer, re-send the hop elsewhere."""
        self.failing.discard(task)
        mb = task.mb
        task.load.in_flight -= task.work
        touch(task.load)
        self.wiring.on_failure(task.load, self.now)
        self.router.banned(task.load)
        self.retries += 1
        mb.exclude = mb.exclude | {task.peer.pid}
        self._send(mb)

    def _poll(self, stage: int) -> None:
        self.poll_pending[stage] = False
        waiting, self.waiting[stage] = self.waiting[stage], []
        for mb in waiting:
            self._send(mb)

    # ---- metrics ----

    def _tick(self, k: int) -> None:
        self._refresh_dht()  # the rate of record changes falls while nothing happens
        self._record_window()
        placed = [0.0] * self.cfg.stages  # recomputed now and then, so that float drift never builds up
        for p in self.present:
            placed[self._placed_stage(p)] += p.thr
        self.placed = placed
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
        self.overhead_series.append(self._overhead_snapshot())

    def unaccounted_microbatches(self) -> int:
        """Microbatches that are neither in flight, nor waiting, nor about to be retried, nor held back
        by the pacing (must be 0)."""
        seen: set[int] = set()
        for p in self.alive:
            for task in itertools.chain(p.queue, p.transit, [p.running] if p.running else []):
                seen.add(task.mb.mid)
        for task in self.failing:
            seen.add(task.mb.mid)
        for waiting in itertools.chain(self.waiting, self.idle):
            seen.update(mb.mid for mb in waiting)
        seen.discard(-1)  # replays
        return self.cfg.in_flight - len(seen)


def run_sim(cfg: SimConfig) -> RunResult:
    """Run one configuration (a top-level function, so that process pools can call it)."""
    return Simulator(cfg).run()
