"""What the simulator moves around: peers, microbatches (and replays) and their hops (tasks), and the
event kinds."""

from __future__ import annotations

import math
from collections import deque

from swarm.policy.rebalance import PeerInfo
from swarm.policy.wiring import PeerLoad
from swarm.sim.routing import sim_load

JOINING, ONLINE, DRAINING, MOVING, DEAD = range(5)
(ARRIVE, DONE, FAIL, PREEMPT, JOIN, READY, REMOVE, REBALANCE, POLL, TICK) = range(10)
(UPDATE, SEEN, RETRY_UPDATE, REPLAY, DISCOVER) = range(10, 15)
NO_EXCLUDE: frozenset[str] = frozenset()


class Peer:
    __slots__ = tuple(
        "idx pid thr bw lat stage dst state queue queued_work running run_start transit loads placed_at "
        "held info replica_of".split()
    )

    def __init__(self, idx: int, thr: float, bw: float, lat: float, trainers: int) -> None:
        self.idx, self.pid, self.thr, self.bw, self.lat = idx, f"p{idx:06d}", thr, bw, lat
        self.stage = self.dst = 0
        self.state = JOINING
        self.queue: deque[Task] = deque()
        self.queued_work = 0.0
        self.running: Task | None = None
        self.run_start = 0.0
        self.transit: dict[Task, None] = {}  # a dict, not a set: iteration order must not depend on ids
        # what each trainer knows about this peer: one PeerLoad per trainer, as in the real trainers
        self.loads: list[PeerLoad] = [sim_load(self.pid, thr) for _ in range(trainers)]
        for load in self.loads:
            load.peer = self  # the simulator's way back from a trainer's view to the peer
        self.placed_at = -math.inf
        # gradients accumulated here and not yet applied: step -> [(trainer, samples)], one per contribution
        self.held: dict[int, list[tuple[int, float]]] = {}
        self.info = PeerInfo(self.pid, 0, thr)  # what plan_move sees (rebuilt when the stage changes)
        self.replica_of = 0  # DHT stage records this peer stores as one of their replicas

    def place(self, stage: int) -> None:
        """Serve (or join, or move to) `stage` from now on."""
        self.stage = stage
        self.info = PeerInfo(self.pid, stage, self.thr)


class Microbatch:
    """A trainer's microbatch (one slot of its in-flight window), or a replay: one held backward
    re-sent to another peer of its stage after the peer holding its gradient died or left."""

    __slots__ = ("mid", "trainer", "hop", "t0", "sender", "exclude", "tag", "n", "replay")

    def __init__(self, mid: int, trainer: int, hop: int, t0: float) -> None:
        self.mid, self.trainer, self.hop = mid, trainer, hop
        self.t0 = t0  # when its trip started (negative: before the run, mid-way through the pipeline)
        self.sender: Peer | None = None  # the peer that holds the activations for the next hop
        self.exclude: frozenset[str] = NO_EXCLUDE
        self.tag = 0  # the step its samples are for (swarm.policy.pacing)
        self.n = 0.0  # samples
        self.replay = False


class Task:
    """One attempt at one hop of one microbatch on one peer."""

    __slots__ = ("mb", "peer", "load", "work", "lost")

    def __init__(self, mb: Microbatch, peer: Peer, load: PeerLoad, work: float) -> None:
        self.mb, self.peer, self.load, self.work, self.lost = mb, peer, load, work, False
