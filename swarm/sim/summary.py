"""A run's figures from the simulator's measurements: averages over the windows after the warm-up."""

from __future__ import annotations

import math
import statistics
from typing import Protocol

from swarm.sim.config import RunResult, SimConfig


class Measured(Protocol):
    """What swarm.sim.engine.Simulator records while it runs."""

    cfg: SimConfig
    trips: list[tuple[float, float]]
    n_windows: int
    done_samples: list[float]
    ideal: list[float]
    assignment: list[float]
    useful_compute: float
    wasted_compute: float
    b: float
    retries: int
    preemptions: int
    joins: int
    moves: int
    rounds: int
    hops: int
    completed: int
    alive: list

    def unaccounted_microbatches(self) -> int: ...


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None  # no microbatch made a whole trip after the warm-up (JSON null, not NaN)
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def warm_up(sim: Measured) -> float:
    """Seconds to leave out of the averages: --warmup, else 1.25 median microbatch trips, within a quarter
    to a half of the run. The microbatches start spread over the pipeline and count only the work they do
    in the simulation, so completions ramp up over about one trip before they measure the swarm."""
    cfg = sim.cfg
    if cfg.warmup is not None:
        return min(cfg.warmup, cfg.sim_seconds)
    trip = statistics.median(lat for _, lat in sim.trips) if sim.trips else 0.0
    return min(0.5 * cfg.sim_seconds, max(0.25 * cfg.sim_seconds, 1.25 * trip))


def summarize(sim: Measured, wall_s: float, cpu_s: float) -> RunResult:
    """Averages over the windows after the warm-up, weighted by their length."""
    cfg = sim.cfg
    w, n = cfg.window, sim.n_windows
    durations = [min(cfg.sim_seconds, (k + 1) * w) - k * w for k in range(n)]
    first = min(n - 1, math.ceil(warm_up(sim) / w - 1e-9))
    span = sum(durations[first:])
    achieved = sum(sim.done_samples[first:]) / span
    ideal = sum(i * d for i, d in zip(sim.ideal[first:], durations[first:], strict=True)) / span
    placed = sum(a * d for a, d in zip(sim.assignment[first:], durations[first:], strict=True)) / span
    latencies = sorted(lat for t, lat in sim.trips if t >= first * w)
    compute = sim.useful_compute + sim.wasted_compute
    return RunResult(
        policy=cfg.policy,
        rebalance=cfg.rebalance,
        peers=cfg.peers,
        stages=cfg.stages,
        sim_seconds=cfg.sim_seconds,
        microbatch_samples=sim.b,
        in_flight=cfg.in_flight,
        throughput=achieved,
        ideal_throughput=ideal,
        throughput_fraction_of_ideal=achieved / ideal if ideal > 0 else 0.0,
        placement_fraction_of_ideal=placed / ideal if ideal > 0 else 0.0,
        latency_p50_s=_percentile(latencies, 0.50),
        latency_p99_s=_percentile(latencies, 0.99),
        wasted_work_fraction=sim.wasted_compute / compute if compute > 0 else 0.0,
        retries=sim.retries,
        preemptions=sim.preemptions,
        joins=sim.joins,
        moves=sim.moves,
        rebalance_rounds=sim.rounds,
        hops=sim.hops,
        microbatches_completed=sim.completed,
        lost_microbatches=sim.unaccounted_microbatches(),
        final_peers=len(sim.alive),
        warmup_s=first * w,
        wall_s=wall_s,
        cpu_s=cpu_s,
        series={
            "t": [min(cfg.sim_seconds, (k + 1) * w) for k in range(n)],
            "throughput": [s / d for s, d in zip(sim.done_samples, durations, strict=True)],
            "ideal": list(sim.ideal),
            "placement": list(sim.assignment),
        },
    )
