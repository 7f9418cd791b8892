#!/usr/bin/env python3
"""Time `swarm sim --peers 10000 --stages 16` (one simulated hour, our wiring with rebalancing, 10% of
the peers preempted per hour) as the command line runs it, once with fixed Info polling periods (the
code before 2026-12-05) and once with the per-peer budget (the code now: swarm.policy.polling), and
print one JSON line:
wall and CPU seconds of each command, its headline figures, and how the polling cost grows with
trainers x peers (computed from the same model, swarm.sim.overheads).

    python scripts/bench_sim.py            # 10,000 peers x 16 stages x 1 h: target < 60 s wall each
    python scripts/bench_sim.py --quick    # 200 peers x 4 stages x 15 min (the test suite runs this)

CPU seconds are the child's own (user + system), so they hold whatever else the machine is doing;
wall seconds do not.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.sim.config import SimConfig  # noqa: E402
from swarm.sim.overheads import poll_load, trainer_load  # noqa: E402

TARGET_WALL_S = 60.0
FULL = {"peers": 10_000, "stages": 16, "sim_seconds": 3600.0}
QUICK = {"peers": 200, "stages": 4, "sim_seconds": 900.0}
HEADLINE = (
    "throughput_fraction_of_ideal",
    "fraction_of_ideal_with_overheads",
    "placement_fraction_of_ideal",
    "throughput",
    "ideal_throughput",
    "steps",
    "step_s",
    "update_s",
    "allreduce_s",
    "failed_rounds",
    "replays",
    "preemptions",
    "joins",
    "moves",
    "hops",
    "microbatch_samples",
    "steps_per_sim_step",
    "batch_violations",
    "lost_microbatches",
)


# the code before 2026-12-05 polled Info at this fixed period (the base is 0.25 s since 2026-12-06)
BEFORE_INFO_PERIOD_S = 0.1


def run_command(size: dict, polling: str, seed: int, extra: list[str]) -> dict:
    """One `swarm sim` command in a child process: its wall and CPU seconds and its headline figures."""
    if polling == "fixed":
        extra = ["--info-period", str(BEFORE_INFO_PERIOD_S), *extra]
    with tempfile.TemporaryDirectory() as out_dir:
        argv = [sys.executable, "-m", "swarm.cli", "sim", "--peers", str(size["peers"]), "--stages"]
        argv += [str(size["stages"]), "--sim-seconds", str(size["sim_seconds"]), "--polling", polling]
        argv += ["--seed", str(seed), "--json", "--no-plots", "--out-dir", out_dir, *extra]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, check=True)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    run = doc["runs"][0]
    return {
        "command": " ".join(["swarm", *argv[3 : argv.index("--json")]]),
        "polling": polling,
        "wall_s": round(wall, 2),
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2),
        "sim_cpu_s": run["cpu_s"],  # the simulation alone, without start-up and output
        "wall_ok": wall < TARGET_WALL_S,
        **{k: run[k] for k in HEADLINE},
        "overheads": run["overheads"],
    }


def polling_costs() -> list[dict]:
    """Per-peer and per-trainer Info load with 16 stages, by peers and trainers, fixed and budget."""
    rows = []
    for polling in ("fixed", "budget"):
        cfg = replace(SimConfig(), polling=polling)
        if polling == "fixed":
            cfg = replace(cfg, info_period=BEFORE_INFO_PERIOD_S)
        for peers in (100, 1000, 10_000):
            for trainers in (1, 10, 100):
                load = poll_load(peers // 16, trainers, cfg)
                polls, cores = trainer_load(peers, cfg, load)
                rows.append(
                    {
                        "polling": polling,
                        "peers": peers,
                        "trainers": trainers,
                        "peer_answers_s": round(load.answers_s, 1),
                        "peer_polls_s": round(load.polls_s, 1),
                        "peer_cpu_share": round(load.cpu_share, 4),
                        "peer_link_mbps": round(load.link_bps * 8 / 1e6, 2),
                        "poll_period_s": round(load.period_s, 3),
                        "trainer_polls_s": round(polls, 1),
                        "trainer_cores": round(cores, 3),
                    }
                )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="200 peers x 4 stages x 15 simulated minutes")
    p.add_argument("--polling", choices=["fixed", "budget", "both"], default="both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("extra", nargs="*", help="more `swarm sim` options, after --")
    args = p.parse_args()
    size = QUICK if args.quick else FULL
    modes = ["fixed", "budget"] if args.polling == "both" else [args.polling]
    runs = [run_command(size, mode, args.seed, args.extra) for mode in modes]
    doc = {"quick": args.quick, **size, "target_wall_s": TARGET_WALL_S, "runs": runs, "polling_costs": polling_costs()}
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
