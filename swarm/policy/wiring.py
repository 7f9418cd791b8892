"""Stochastic wiring: which peer of a stage takes the next microbatch.

The rule: the lowest expected finish time, (queued work + this task) / throughput, with a random
tie-break. A peer's queued work is what this trainer has in flight there plus what the peer last
reported queued. Faster peers get proportionally more work, and a new peer with an empty queue is
probed at once. A failed call bans the peer with an exponentially growing back-off.

This module is pure logic (no I/O): the trainer and the simulator both use it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

MIN_THROUGHPUT = 1e-3  # samples/s, so an unmeasured peer is still choosable
# a backward goes to the peer that ran its forward (it may hold the activations: a third less compute)
# unless that peer's expected finish is more than this factor above the best one's
PREFER_SLACK = 1.5


@dataclass
class PeerLoad:
    """What a trainer knows about one peer of a stage."""

    peer_id: str
    stage: int
    address: str
    throughput: float = 1.0  # samples/s the peer reports (compute)
    e2e_throughput: float | None = None  # samples/s this trainer observes, network included
    reported_queue: float = 0.0  # samples queued at the peer, as last reported
    in_flight: float = 0.0  # samples this trainer has outstanding at the peer
    online: bool = True
    banned_until: float = 0.0
    failures: int = 0  # consecutive failures (sets the ban length)
    total_failures: int = 0
    assigned: int = 0  # microbatches assigned, for metrics and tests

    @property
    def effective_throughput(self) -> float:
        if self.e2e_throughput is not None:
            # the slower of the two: a fast GPU behind a slow link is a slow peer
            return max(MIN_THROUGHPUT, min(self.throughput, self.e2e_throughput))
        return max(MIN_THROUGHPUT, self.throughput)

    def expected_finish(self, task_samples: float) -> float:
        return (self.reported_queue + self.in_flight + task_samples) / self.effective_throughput


@dataclass(frozen=True)
class BanPolicy:
    base_s: float = 1.0
    max_s: float = 60.0

    def duration(self, failures: int) -> float:
        return min(self.max_s, self.base_s * 2 ** max(0, failures - 1))


class Wiring:
    def __init__(
        self, rng: random.Random | None = None, ban: BanPolicy = BanPolicy(), tie_tolerance: float = 1e-9
    ) -> None:
        self.rng = rng or random.Random()
        self.ban = ban
        self.tie_tolerance = tie_tolerance

    def eligible(
        self, peers: list[PeerLoad], now: float, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[PeerLoad]:
        return [p for p in peers if p.online and p.banned_until <= now and p.peer_id not in exclude]

    def choose(
        self,
        peers: list[PeerLoad],
        task_samples: float,
        now: float,
        exclude: frozenset[str] | set[str] = frozenset(),
        prefer: str | None = None,
    ) -> PeerLoad | None:
        """The eligible peer with the lowest expected finish time, ties broken at random; `prefer`
        (a peer id) wins while eligible and within PREFER_SLACK of the best finish time."""
        best: list[PeerLoad] = []
        best_finish = float("inf")
        preferred: tuple[PeerLoad, float] | None = None
        for p in peers:  # one pass: this runs for every hop of every microbatch (and in the simulator)
            if not p.online or p.banned_until > now or p.peer_id in exclude:
                continue
            finish = p.expected_finish(task_samples)
            if p.peer_id == prefer:
                preferred = (p, finish)
            if finish < best_finish * (1 - self.tie_tolerance) - 1e-12:
                best, best_finish = [p], finish
            elif finish <= best_finish * (1 + self.tie_tolerance) + 1e-12:
                best.append(p)
        if not best:
            return None
        if preferred is not None and preferred[1] <= PREFER_SLACK * best_finish + 1e-12:
            chosen = preferred[0]
        else:
            chosen = best[0] if len(best) == 1 else self.rng.choice(best)
        chosen.assigned += 1
        return chosen

    def on_failure(self, peer: PeerLoad, now: float) -> float:
        """Ban the peer; returns the ban's length in seconds."""
        peer.failures += 1
        peer.total_failures += 1
        duration = self.ban.duration(peer.failures)
        peer.banned_until = now + duration
        return duration

    @staticmethod
    def on_success(peer: PeerLoad) -> None:
        peer.failures = 0
