#!/usr/bin/env python3
"""Direct averaging of a stage of 4: whole sums against reduce-scatter, side by side.

`swarm local --stages 3 --peers-per-stage 4 --trainers 2` runs in pairs, one with every stage
averaging by reduce-scatter (`--averaging-shard-min-mb 0`), one with whole sums (a threshold no
stage reaches), alternating, on the same model. Prints each run's samples/s and an update's
averaging time (the peers' update timelines: fetching the mates' sums or shards, adding them), and
their ratios. The default `--averaging-shard-min-mb` (4 MiB) sits between the two models compared
in docs/BENCHMARKS.md: the default GPT (1.5-1.7 MiB of float32 gradient per stage), where the
reduce-scatter's extra round trip costs more than the bytes it saves on this machine, and gpt-small
(6.3-9.4 MiB), where it saves more.

    .venv/bin/python scripts/bench_sharding.py --json                     # gpt-small, 20 steps, 2 pairs
    .venv/bin/python scripts/bench_sharding.py --model gpt --steps 40 --json
    .venv/bin/python scripts/bench_sharding.py --quick --json             # tiny model, 3 steps, 1 pair
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from scripts.bench_overload import TINY  # noqa: E402
from scripts.local_runs import swarm_local_json  # noqa: E402

MODES = {"reduce-scatter": "0", "whole sums": "1000000"}  # --averaging-shard-min-mb


def averaging_figures(summary: dict, mode: str) -> dict:
    """One run's figures from its `swarm local --json` summary (the peers' shutdown counters)."""
    peers = summary.get("peers", [])
    updates = sum(p["update_timeline"].get("updates", 0) for p in peers if p.get("update_timeline"))
    allreduce = sum(p["update_timeline"].get("allreduce_s", 0.0) for p in peers if p.get("update_timeline"))
    return {
        "mode": mode,
        "samples_per_s": round(summary["samples_per_s"], 2),
        "averaging_ms_per_update": round(1000 * allreduce / max(1, updates), 1),
        "updates": updates,
        "sharded_rounds": sum(p.get("sharded_rounds", 0) for p in peers),
        "steps": summary["steps"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-small", help="a preset (gpt, gpt-small) or tiny (default %(default)s)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=2, help="runs of each mode, alternating (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps, one pair: a check that it runs")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model, steps, pairs = ("tiny", 3, 1) if args.quick else (args.model, args.steps, args.pairs)
    spec = json.dumps(TINY) if model == "tiny" else model
    t0 = time.monotonic()
    rows = []
    for _ in range(pairs):
        for mode, min_mb in MODES.items():
            cmd = ["--stages", "3", "--peers-per-stage", "4", "--trainers", "2", "--steps", str(steps)]
            print(f"swarm local {' '.join(cmd)} --model {model} ({mode}) ...", file=sys.stderr, flush=True)
            cmd += ["--model", spec, "--trainer-arg=--val-samples=0", "--peer-arg=--no-rebalance"]
            cmd += ["--peer-arg=--averaging-shard-min-mb", f"--peer-arg={min_mb}"]
            rows.append(averaging_figures(swarm_local_json(cmd), mode))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(f"{'mode':>15} {'samples/s':>10} {'averaging ms/update':>20} {'sharded rounds':>15}")
    for r in rows:
        print(
            f"{r['mode']:>15} {r['samples_per_s']:>10.2f} {r['averaging_ms_per_update']:>20.1f} "
            f"{r['sharded_rounds']:>15}"
        )
    mean = {m: [r for r in rows if r["mode"] == m] for m in MODES}
    out: dict = {"model": model, "runs": rows, "wall_s": round(time.monotonic() - t0, 1)}
    sps = {m: sum(r["samples_per_s"] for r in rs) / len(rs) for m, rs in mean.items()}
    avg = {m: sum(r["averaging_ms_per_update"] for r in rs) / len(rs) for m, rs in mean.items()}
    if sps["whole sums"] and avg["whole sums"]:
        out["samples_per_s_sharded_vs_whole"] = round(sps["reduce-scatter"] / sps["whole sums"], 3)
        out["averaging_ms_sharded_vs_whole"] = round(avg["reduce-scatter"] / avg["whole sums"], 3)
        print(
            f"reduce-scatter vs whole sums: samples/s x{out['samples_per_s_sharded_vs_whole']:.3f}, "
            f"averaging time x{out['averaging_ms_sharded_vs_whole']:.3f}"
        )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
