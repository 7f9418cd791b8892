"""A run's figures from the simulator's measurements: averages over the windows after the warm-up."""

from __future__ import annotations

import math
from typing import Protocol

from swarm.sim.config import RunResult, SimConfig

WARMUP_SHARE = 0.25


class Measured(Protocol):
    """What swarm.sim.engine.Simulator records while it runs."""

    cfg: SimConfig
    trips: list[tuple[float, float]]
    n_windows: int
    done_samples: list[float]
    ideal: list[float]
    assignment: list[float]
    overhead_series: list[dict[str, float]]
    real_step: int
    k: int
    failed_rounds: int
    replays: int
    batch_violations: int
    idle_area: float
    router: object
    useful_compute: float
    wasted_compute: float
    b: float
    retries: int
    preemptions: int
    joins: int
    moves: int
    rounds_run: int
    hops: int
    completed: int
    alive: list

    def unaccounted_microbatches(self) -> int: ...

    def step_figures(self, start: float) -> dict[str, float]: ...


def _none_if_nan(x: float) -> float | None:
    return None if math.isnan(x) else x


def _overheads(sim: Measured, first: int, durations: list[float], ideal: float) -> tuple[dict[str, float], float]:
    """Means of the polling figures after the warm-up, and the ideal with the overheads the peers would
    pay at the ideal assignment: their polling CPU share and, in exact mode, one update round per step."""
    span = sum(durations[first:])
    snapshots = sim.overhead_series[first:]
    means = {
        key: sum(s[key] * d for s, d in zip(snapshots, durations[first:], strict=True)) / span for key in snapshots[0]
    }
    with_overheads = ideal * means.pop("ideal_cpu_share")
    update = sim.step_figures(first * sim.cfg.window)["update_s"]
    if sim.cfg.sync == "exact" and with_overheads > 0 and not math.isnan(update):
        batch = sim.cfg.global_batch  # per optimizer step, which pays one round
        with_overheads = batch / (batch / with_overheads + update)
    return means, with_overheads


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None  # no microbatch made a whole trip after the warm-up (JSON null, not NaN)
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def warm_up(sim: Measured) -> float:
    """Seconds to leave out of the averages: --warmup, else a quarter of the run. The run starts from a
    snapshot of a swarm at work (microbatches spread over the pipeline, counted in full when they
    complete), but queues, placement and the steps' rhythm take a while to settle."""
    cfg = sim.cfg
    if cfg.warmup is not None:
        return min(cfg.warmup, cfg.sim_seconds)
    return WARMUP_SHARE * cfg.sim_seconds


def _step_fields(sim: Measured, first: int, durations: list[float], achieved: float, ideal: float) -> dict:
    """The RunResult fields of the steps (barrier, rounds) and of the polling, after the warm-up."""
    cfg = sim.cfg
    steps = sim.step_figures(first * cfg.window)
    overheads, ideal_oh = _overheads(sim, first, durations, ideal)
    return {
        "sync": cfg.sync,
        "polling": cfg.polling,
        "global_batch": cfg.global_batch,
        "steps_per_sim_step": sim.k,
        "steps": sim.real_step,
        "step_s": _none_if_nan(steps["step_s"]),
        "update_s": _none_if_nan(steps["update_s"]),
        "allreduce_s": _none_if_nan(steps["allreduce_s"]),
        "failed_rounds": sim.failed_rounds,
        "replays": sim.replays,
        "batch_violations": sim.batch_violations,
        "pacing_idle_fraction": sim.idle_area / (cfg.in_flight * cfg.sim_seconds),
        "ideal_with_overheads": ideal_oh,
        "fraction_of_ideal_with_overheads": achieved / ideal_oh if ideal_oh > 0 else 0.0,
        "overheads": overheads,
        "route_fallbacks": sim.router.fallbacks,
    }


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
        rebalance_rounds=sim.rounds_run,
        hops=sim.hops,
        microbatches_completed=sim.completed,
        lost_microbatches=sim.unaccounted_microbatches(),
        final_peers=len(sim.alive),
        **_step_fields(sim, first, durations, achieved, ideal),
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
