#!/usr/bin/env python3
"""Overload: more peers than the machine has cores, no fault injected. `swarm local --stages 3
--peers-per-stage 4 --trainers 2` (12 peers and 2 trainers on this 2-core machine) next to the same
run with 2 peers per stage, in one invocation.

What should hold under overload: no peer counted as failed (a slow peer gets less work, it is not
declared dead), retries plus replays under 5% of the microbatches, every stage processing the
samples scheduled and no more (no recompute of duplicates), and samples/s at least 0.6x the 3x2 run's.

    .venv/bin/python scripts/bench_overload.py --json            # default GPT, 40 steps each
    .venv/bin/python scripts/bench_overload.py --steps 20 --model tiny

Prints a table, and with --json one JSON line last.
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

from scripts.local_runs import swarm_local_json  # noqa: E402

GLOBAL_BATCH = 32
TINY = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64}


def figures(summary: dict, per_stage: int, stages: int) -> dict:
    """The overload figures of one `swarm local --json` summary."""
    steps, batch = summary["steps"], GLOBAL_BATCH
    scheduled = steps * batch
    by_stage: dict[int, dict[str, int]] = {}
    # each peer's counters at its last stage, and those of the stages it left (a move restarts them)
    parts = [(c["stage"], c) for c in summary.get("peers", []) if c.get("stage") is not None]
    parts += [(s, e) for c in summary.get("peers", []) for s, e in (c.get("earlier_stages") or {}).items()]
    for stage, c in parts:
        row = by_stage.setdefault(int(stage), {"processed": 0, "duplicates": 0, "checks": 0})
        row["processed"] += int(c.get("samples_processed", 0))
        row["duplicates"] += int(c.get("duplicate_samples", 0))
        row["checks"] += int(c.get("check_samples", 0))
    microbatches = max(1, summary.get("microbatches_started", 0))
    redone = summary["retries"] + summary["replays"]
    return {
        "peers_per_stage": per_stage,
        "samples_per_s": round(summary["samples_per_s"], 2),
        "steps": steps,
        "failed_peers": summary["peer_failures"],
        "retries": summary["retries"],
        "replays": summary["replays"],
        "microbatches": microbatches,
        "retries_and_replays_share": round(redone / microbatches, 4),
        "samples_scheduled": scheduled,
        # per stage: backward samples accumulated as new contributions, beside the work spent on
        # duplicates (recomputed, nothing added) and spot checks (the trainers' honesty checks)
        "samples_processed_by_stage": {
            k: v["processed"] - v["duplicates"] - v["checks"] for k, v in sorted(by_stage.items())
        },
        "duplicate_samples_by_stage": {k: v["duplicates"] for k, v in sorted(by_stage.items())},
        "check_samples_by_stage": {k: v["checks"] for k, v in sorted(by_stage.items())},
        "stages": stages,
        "val_loss": summary.get("val_loss"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--model", default="gpt", help="gpt (the default model) or tiny")
    p.add_argument("--per-stage", default="2,4", help="peers per stage of the runs, in order (%(default)s)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--log-dir", help="keep each run's process logs under this folder (default: discarded)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    rows = []
    for per_stage in [int(n) for n in args.per_stage.split(",")]:
        extra = ["--model", json.dumps(TINY)] if args.model == "tiny" else []
        cmd = ["--stages", "3", "--peers-per-stage", str(per_stage), "--trainers", "2", "--steps", str(args.steps)]
        print(f"swarm local {' '.join(cmd)} ...", file=sys.stderr, flush=True)
        cmd += ["--global-batch", str(GLOBAL_BATCH), "--trainer-arg=--val-samples=0"]
        logs = None if args.log_dir is None else str(Path(args.log_dir) / f"3x{per_stage}")
        summary = swarm_local_json(cmd + extra, log_dir=logs)
        row = figures(summary, per_stage, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    head = f"{'peers/stage':>11} {'samples/s':>10} {'failed':>7} {'retries':>8} {'replays':>8} {'redone':>7}"
    print(head + "  processed/scheduled")
    for r in rows:
        processed = ", ".join(f"{v}" for v in r["samples_processed_by_stage"].values())
        print(
            f"{r['peers_per_stage']:>11} {r['samples_per_s']:>10.2f} {r['failed_peers']:>7} {r['retries']:>8} "
            f"{r['replays']:>8} {r['retries_and_replays_share']:>7.1%}  {processed} / {r['samples_scheduled']}"
        )
    out = {"runs": rows, "wall_s": round(time.monotonic() - t0, 1)}
    if len(rows) >= 2 and rows[0]["samples_per_s"]:
        out["ratio_last_vs_first"] = round(rows[-1]["samples_per_s"] / rows[0]["samples_per_s"], 3)
        print(
            f"samples/s {rows[-1]['peers_per_stage']}/stage vs {rows[0]['peers_per_stage']}/stage: "
            f"{out['ratio_last_vs_first']:.3f} (target >= 0.6)"
        )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
