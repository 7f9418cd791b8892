"""Adaptive rebalancing: which single peer, if any, should move to which stage.

Pure logic, no I/O: the peers and the simulator (swarm.sim) both call `plan_move`.

Objective: the swarm's throughput is the minimum over stages of the sum of their peers' throughput.
Ties on the minimum are broken by the next-smallest stage and so on (lexicographic max-min), so that
from a layout like 3,1,1 of equal peers a peer still moves to make it 2,2,1: the same pipeline speed,
and a stage that survives the loss of one peer.

A move is planned only if it raises the first stage total it changes by more than `threshold` times
the mean peer's throughput: a margin against measurement noise in the unit of what one move can
bring. (Relative to the stage total, as first written, no single move qualified once stages held
more than 1/threshold peers: rebalancing switched itself off in large swarms; `swarm sim` showed it.)
Each planned move strictly improves a finite order, so moves cannot cycle
(no ping-pong), and a stage is never emptied. Every peer computes the same plan from the same view;
only the peer named in the plan moves, so one peer moves per round.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# a move must raise the slowest stage by this fraction of the mean peer's throughput (peers' and the
# simulator's default)
DEFAULT_THRESHOLD = 0.1


@dataclass(frozen=True)
class PeerInfo:
    peer_id: str
    stage: int
    throughput: float  # samples/s on its current stage


@dataclass(frozen=True)
class Move:
    peer_id: str
    src: int
    dst: int
    before: float  # swarm throughput (min over stages) before the move
    after: float  # ... and after
    reason: str


def stage_totals(peers: list[PeerInfo], num_stages: int) -> list[float]:
    totals = [0.0] * num_stages
    for p in peers:
        totals[p.stage] += p.throughput
    return totals


def better(after: list[float], before: list[float], margin: float = 0.0) -> bool:
    """Lexicographic max-min: compare the sorted stage totals; the first one that differs decides,
    and it must have grown by more than `margin` (absolute). This is a strict order (equality is
    exact up to float noise), so a sequence of moves can never come back to an earlier layout."""
    for a, b in zip(sorted(after), sorted(before), strict=True):
        if abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1e-12):
            continue
        return a > b + margin
    return False


def moved_throughput(throughput: float, src: int, dst: int, stage_costs: list[float] | None) -> float:
    """A peer's expected throughput on stage `dst` given its measured one on `src`."""
    if stage_costs is None:
        return throughput
    return throughput * stage_costs[src] / max(1e-12, stage_costs[dst])


def plan_move(
    peers: list[PeerInfo],
    num_stages: int,
    threshold: float = 0.1,
    movable: Mapping[str, bool] | None = None,
    stage_costs: list[float] | None = None,
) -> Move | None:
    """The single move that most improves the swarm's throughput, or None.

    `movable` (peer_id -> bool) excludes peers that may not move now (cooling down after a move,
    just joined); they still count in their stage. `stage_costs` are the stages' relative compute
    per sample (from the model; equal if None): a peer twice as fast on a stage half as costly.
    """
    if not peers:
        return None
    totals = stage_totals(peers, num_stages)
    margin = threshold * sum(p.throughput for p in peers) / len(peers)
    counts = [0] * num_stages
    for p in peers:
        counts[p.stage] += 1
    best: tuple[list[float], PeerInfo, int, float] | None = None
    for p in sorted(peers, key=lambda q: q.peer_id):
        if movable is not None and not movable.get(p.peer_id, True):
            continue
        if counts[p.stage] <= 1:
            continue  # never empty a stage
        for dst in range(num_stages):
            if dst == p.stage:
                continue
            gain = moved_throughput(p.throughput, p.stage, dst, stage_costs)
            after = list(totals)
            after[p.stage] -= p.throughput
            after[dst] += gain
            if not better(after, totals, margin):
                continue
            if best is None or better(after, best[0]):
                best = (after, p, dst, gain)
    if best is None:
        return None
    after, p, dst, _ = best
    reason = f"stage {dst} is the bottleneck ({totals[dst]:.1f} samples/s)"
    if totals[dst] > min(totals):
        reason = f"stage {dst} is among the slowest ({totals[dst]:.1f} samples/s)"
    return Move(p.peer_id, p.stage, dst, min(totals), min(after), reason)


def join_stage(totals: list[float], rng) -> int:
    """Where a new peer adds the most: a stage with the smallest total throughput (random on ties,
    so that peers joining together spread)."""
    least = min(totals)
    return rng.choice([k for k, v in enumerate(totals) if v <= least * (1 + 1e-9) + 1e-12])


def best_assignment_throughput(throughputs: list[float], num_stages: int) -> float:
    """The swarm throughput of a good assignment of these peers (equal stage costs): greedy
    longest-processing-time first, optimal for equal peers and within 4/3 of optimal otherwise."""
    if len(throughputs) < num_stages:
        return 0.0
    totals = [0.0] * num_stages
    for t in sorted(throughputs, reverse=True):
        totals[totals.index(min(totals))] += t
    return min(totals)
