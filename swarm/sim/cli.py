"""`swarm sim`: compare routing policies, with and without rebalancing, on a simulated swarm.

The runs of a comparison are independent (same seed, hence the same peers, preemptions and joins), so
they go to a process pool; results do not depend on how many processes run them.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from swarm.sim.config import (
    DEFAULT_STEP_SECONDS,
    INITIAL_LAYOUTS,
    POLICIES,
    POLLING_MODES,
    SYNC_MODES,
    RunResult,
    SimConfig,
)
from swarm.sim.engine import run_sim
from swarm.sim.report import format_table, json_document, plot, write_results

logger = logging.getLogger(__name__)

DESCRIPTION = """\
Discrete-event simulation of a swarm that runs the real stochastic wiring (swarm.policy.wiring), pacing
(swarm.policy.pacing) and rebalancing (swarm.policy.rebalance) code against simulated peers. It models
what costs time: compute, transfers over each peer's link, the step barrier and the all-reduce of every
stage, Info polls and DHT reads, preemptions and joins. By default one run: our wiring with
rebalancing; --policy all --rebalance both compares ours/uniform/weighted x rebalancing on/off (6 runs,
the same peers, preemptions and joins). Throughputs are in training samples/s (forward+backward) of a
peer on one stage; peer speed, bandwidth and latency are lognormal (median, sigma). See docs/SIMULATOR.md.
"""

EPILOG = """\
example:  swarm sim --peers 10000 --stages 16                      (one run, about 25 CPU-seconds)
          swarm sim --peers 1000 --stages 8 --policy all --rebalance both --json    (6 runs, plots in ./sim_out)
          swarm sim --peers 100 --stages 4 --sync exact --global-batch 200000 --preemption-rate 0.5
"""


def _auto_int(text: str) -> int | None:
    return None if text == "auto" else int(text)


def _auto_float(text: str) -> float | None:
    return None if text == "auto" else float(text)


def add_sim_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `sim` subcommand; `args.func(args)` runs it."""
    d = SimConfig()
    p = subparsers.add_parser(
        "sim",
        help="simulate a swarm of 10..10,000 peers: wiring policies, rebalancing, preemptions",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("what to compare")
    g.add_argument("--peers", type=int, default=d.peers, help="peers at the start (default %(default)s)")
    g.add_argument("--stages", type=int, default=d.stages, help="pipeline stages (default %(default)s)")
    g.add_argument(
        "--sim-seconds", type=float, default=d.sim_seconds, help="simulated duration (default %(default)s s)"
    )
    g.add_argument(
        "--policy",
        choices=[*POLICIES, "all"],
        default=d.policy,
        help="routing: ours = swarm.policy.wiring.Wiring.choose (lowest expected finish time, the default), "
        "uniform = random peer of the stage, weighted = random in proportion to throughput; all = the three",
    )
    g.add_argument(
        "--rebalance",
        choices=["on", "off", "both"],
        default="on" if d.rebalance else "off",
        help="on (default): swarm.policy.rebalance.plan_move every --rebalance-period and joiners use "
        "join_stage; off: no moves, joiners pick a random stage; both: one run each",
    )
    g.add_argument("--seed", type=int, default=0, help="random seed; a run is deterministic for a seed")
    g = p.add_argument_group("peers and churn")
    g.add_argument("--throughput-median", type=float, default=d.throughput_median, help="samples/s (%(default)s)")
    g.add_argument("--throughput-sigma", type=float, default=d.throughput_sigma, help="lognormal sigma (%(default)s)")
    g.add_argument("--bandwidth-median", type=float, default=d.bandwidth_median_mbps, help="Mbit/s (%(default)s)")
    g.add_argument("--bandwidth-sigma", type=float, default=d.bandwidth_sigma, help="lognormal sigma (%(default)s)")
    g.add_argument("--latency-median", type=float, default=d.latency_median_ms, help="one-way ms (%(default)s)")
    g.add_argument("--latency-sigma", type=float, default=d.latency_sigma, help="lognormal sigma (%(default)s)")
    g.add_argument(
        "--activation-kb", type=float, default=d.activation_kb, help="KiB sent per sample per hop (%(default)s)"
    )
    g.add_argument(
        "--compute-jitter", type=float, default=d.compute_jitter, help="lognormal sigma on task times (%(default)s)"
    )
    g.add_argument(
        "--preemption-rate",
        type=float,
        default=d.preemption_rate,
        help="fraction of the alive peers preempted per simulated hour, Poisson (default %(default)s)",
    )
    g.add_argument(
        "--join-rate",
        type=_auto_float,
        default="auto",
        help="new peers per simulated hour as a fraction of --peers (auto: = --preemption-rate, so the count "
        "stays around --peers)",
    )
    g.add_argument("--join-time", type=float, default=d.join_time, help="s before a new peer serves (%(default)s)")
    g.add_argument(
        "--failure-timeout",
        type=float,
        default=d.failure_timeout,
        help="s until a trainer notices a call to a dead peer failed; it then bans the peer and retries the hop "
        "on another peer of the stage (%(default)s)",
    )
    g.add_argument(
        "--dead-after", type=float, default=d.dead_after, help="s until the views drop a dead peer (%(default)s)"
    )
    g.add_argument(
        "--initial",
        choices=INITIAL_LAYOUTS,
        default=d.initial,
        help="stages of the peers present at t=0: join = one by one like later joiners (default), balanced = "
        "largest-first onto the weakest stage, random, skewed = one per stage and the rest on stage 0",
    )
    g = p.add_argument_group("trainers and microbatches")
    g.add_argument(
        "--trainers",
        type=int,
        default=d.trainers,
        help="independent trainers, each with its own view of the peers' load (default %(default)s)",
    )
    g.add_argument(
        "--in-flight", type=_auto_int, default="auto", help="microbatches in flight in all (auto: 2 per peer)"
    )
    g.add_argument(
        "--microbatch-samples",
        type=_auto_float,
        default="auto",
        help="samples per simulated microbatch (auto: sized so that each peer serves about --hops-per-peer hops; "
        "coarse microbatches keep 1000 peers under a minute)",
    )
    g.add_argument(
        "--hops-per-peer",
        type=_auto_float,
        default="auto",
        help="hops each peer serves in a run, which sets the auto microbatch size (auto: 100, up to 300,000 hops a "
        "run in small swarms, at most 3000 per peer and simulated hour); a run costs about 25 CPU-microseconds a hop",
    )
    g.add_argument(
        "--report-running",
        action="store_true",
        help="peers report the task being computed as queued too (the real executor's queue leaves it out)",
    )
    g.add_argument(
        "--check-routing",
        action="store_true",
        help="check every pick of the fast routing against Wiring.choose itself (slow; for tests)",
    )
    _add_step_options(p, d)
    _add_polling_options(p, d)
    g = p.add_argument_group("rebalancing")
    g.add_argument(
        "--rebalance-period", type=float, default=d.rebalance_period, help="s between rounds, x0.7..1.3 (%(default)s)"
    )
    g.add_argument(
        "--rebalance-threshold",
        type=float,
        default=d.rebalance_threshold,
        help="plan_move's threshold: a move must raise the bottleneck by this fraction of the mean peer's "
        "throughput (default %(default)s, the peers' default)",
    )
    g.add_argument("--move-time", type=float, default=d.move_time, help="s a moved peer is unavailable (%(default)s)")
    g.add_argument(
        "--move-cooldown",
        type=float,
        default=d.move_cooldown,
        help="s after joining/moving before moving (%(default)s)",
    )
    g.add_argument(
        "--plan-candidates",
        type=_auto_int,
        default="auto",
        help="movable peers per stage offered to plan_move each round, 0 = all (auto: all up to 48 peers, else 1; "
        "plan_move costs O(peers x stages) sorted comparisons per movable peer)",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--warmup",
        type=_auto_float,
        default="auto",
        help="s left out of the averages (auto: a quarter of the run)",
    )
    g.add_argument("--out-dir", default="sim_out", help="where results.json and the PNG plots go (%(default)s)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    g.add_argument(
        "--jobs", type=int, default=0, help="parallel processes (default: as many as CPUs, at most one per run)"
    )
    p.set_defaults(func=cmd_sim)
    return p


def _add_step_options(p: argparse.ArgumentParser, d: SimConfig) -> None:
    g = p.add_argument_group(
        "steps",
        "each stage applies update t once it holds the global batch for t (the barrier),\n"
        "after its peers notice it, agree on its contents and all-reduce the gradient",
    )
    g.add_argument(
        "--sync",
        choices=SYNC_MODES,
        default=d.sync,
        help="async (default): trainers start up to --max-staleness steps' worth of samples ahead of the slowest "
        "stage; exact: step t+1 starts only once every stage applied t",
    )
    g.add_argument(
        "--global-batch",
        type=_auto_float,
        default="auto",
        help=f"samples per optimizer step (auto: {DEFAULT_STEP_SECONDS:.0f} s of the swarm's mean throughput). A "
        "simulated step stands for several optimizer steps when the batch is small next to the samples in flight "
        "(see docs/SIMULATOR.md, 'Coarse steps')",
    )
    g.add_argument(
        "--max-staleness", type=float, default=d.max_staleness, help="async: steps ahead (%(default)s, as the trainers)"
    )
    g.add_argument(
        "--ahead-after",
        type=float,
        default=d.ahead_after,
        help="async: share of a step done before the next starts (%(default)s, as the trainers)",
    )
    g.add_argument(
        "--stage-param-mb",
        type=float,
        default=d.stage_param_mb,
        help="MB of gradient every peer of a stage all-reduces per step: a butterfly all-reduce moves about "
        "2x this x (n-1)/n over each peer's link (default %(default)s)",
    )


def _add_polling_options(p: argparse.ArgumentParser, d: SimConfig) -> None:
    g = p.add_argument_group(
        "Info polls and DHT reads",
        "every peer polls its stage-mates' Info, every trainer every peer's, and every process\n"
        "reads all stage records; each exchange costs the answering and the asking peer CPU time\n"
        "and bytes on its link",
    )
    g.add_argument(
        "--polling",
        choices=POLLING_MODES,
        default=d.polling,
        help="budget (default, as the code does: swarm.policy.polling): a peer answers at most --info-budget "
        "polls/s (its pollers stretch their period) and a record replica serves at most --info-budget reads/s "
        "and --dht-budget-mbps; fixed: every --info-period and --dht-period, whatever the swarm's size (the "
        "code before the budget)",
    )
    g.add_argument("--info-period", type=float, default=d.info_period, help="s between polls (%(default)s)")
    g.add_argument(
        "--info-cost-ms", type=float, default=d.info_cost_ms, help="CPU ms per Info exchange, each end (%(default)s)"
    )
    g.add_argument("--info-bytes", type=float, default=d.info_bytes, help="bytes per Info exchange (%(default)s)")
    g.add_argument(
        "--info-budget", type=float, default=d.info_budget, help="budget: polls/s a peer answers (%(default)s)"
    )
    g.add_argument("--dht-period", type=float, default=d.dht_period, help="s between DHT reads (%(default)s)")
    g.add_argument(
        "--dht-record-bytes",
        type=float,
        default=d.dht_record_bytes,
        help="bytes per peer in a stage record, signed (%(default)s)",
    )
    g.add_argument("--dht-replicas", type=int, default=d.dht_replicas, help="peers storing each record (%(default)s)")
    g.add_argument(
        "--dht-budget-mbps",
        type=float,
        default=d.dht_budget_mbps,
        help="budget: Mbit/s a record replica serves (%(default)s)",
    )
    g.add_argument(
        "--dht-quiet-factor",
        type=float,
        default=d.dht_quiet_factor,
        help="budget: a view's DHT period after three reads in a row without news, in periods (%(default)s; 1: "
        "always the base period, the code before 2026-12-07)",
    )


def configs_from_args(args: argparse.Namespace) -> list[SimConfig]:
    base = SimConfig(
        peers=args.peers,
        stages=args.stages,
        sim_seconds=args.sim_seconds,
        seed=args.seed,
        throughput_median=args.throughput_median,
        throughput_sigma=args.throughput_sigma,
        bandwidth_median_mbps=args.bandwidth_median,
        bandwidth_sigma=args.bandwidth_sigma,
        latency_median_ms=args.latency_median,
        latency_sigma=args.latency_sigma,
        activation_kb=args.activation_kb,
        compute_jitter=args.compute_jitter,
        preemption_rate=args.preemption_rate,
        join_rate=args.join_rate,
        join_time=args.join_time,
        failure_timeout=args.failure_timeout,
        dead_after=args.dead_after,
        initial=args.initial,
        trainers=args.trainers,
        in_flight=args.in_flight,
        microbatch_samples=args.microbatch_samples,
        hops_per_peer=args.hops_per_peer,
        report_running=args.report_running,
        check_routing=args.check_routing,
        sync=args.sync,
        global_batch=args.global_batch,
        max_staleness=args.max_staleness,
        ahead_after=args.ahead_after,
        stage_param_mb=args.stage_param_mb,
        polling=args.polling,
        info_period=args.info_period,
        info_cost_ms=args.info_cost_ms,
        info_bytes=args.info_bytes,
        info_budget=args.info_budget,
        dht_period=args.dht_period,
        dht_record_bytes=args.dht_record_bytes,
        dht_replicas=args.dht_replicas,
        dht_budget_mbps=args.dht_budget_mbps,
        dht_quiet_factor=args.dht_quiet_factor,
        rebalance_period=args.rebalance_period,
        rebalance_threshold=args.rebalance_threshold,
        move_time=args.move_time,
        move_cooldown=args.move_cooldown,
        plan_candidates=args.plan_candidates,
        warmup=args.warmup,
    )
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    settings = {"on": [True], "off": [False], "both": [True, False]}[args.rebalance]
    return [replace(base, policy=p, rebalance=r) for p in policies for r in settings]


def run_all(configs: list[SimConfig], jobs: int = 0) -> list[RunResult]:
    """Run every configuration, in parallel processes when there are several; results in input order."""
    jobs = jobs or min(len(configs), os.cpu_count() or 1)
    if jobs <= 1 or len(configs) == 1:
        return [run_sim(c) for c in configs]
    # "spawn": the parent may hold threads (gRPC, torch) that fork would copy in a broken state
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        return list(pool.map(run_sim, configs))


def cmd_sim(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    try:
        configs = configs_from_args(args)
        for c in configs:
            c.resolved()
    except ValueError as e:
        print(f"swarm sim: {e}", file=sys.stderr)
        return 2
    logger.info("simulating %d run(s) of %d peers, %d stages", len(configs), args.peers, args.stages)
    results = run_all(configs, args.jobs)
    out_dir = Path(args.out_dir)
    wall_s = time.perf_counter() - started
    write_results(results, [asdict(c.resolved()) for c in configs], out_dir, wall_s)
    if not args.no_plots:
        plot(results, out_dir)
    wall_s = time.perf_counter() - started
    doc = json_document(results, wall_s)
    if args.json:
        print(json.dumps(doc))
    else:
        print(format_table(results))
        head = configs[0].resolved()
        print(
            f"\n{args.peers} peers, {args.stages} stages, {args.sim_seconds:.0f} simulated s, microbatches of "
            f"{head.microbatch_samples:.0f} samples, {head.in_flight} in flight; "
            f"averages after each run's warm-up; wall {wall_s:.1f} s; results in {out_dir}/"
        )
    return 0
