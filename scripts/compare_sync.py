#!/usr/bin/env python
"""Exact vs async synchronization, side by side: the same local swarm, the same number of steps (so
the same number of samples), once with --sync exact and once with --sync async.

    python scripts/compare_sync.py [--steps 200] [--stale] [--json] [-- extra swarm local arguments]

Reports each mode's validation loss and samples/s, and async's relative differences. --stale adds a
third run: async without the look-ahead (--no-predict-params), i.e. plain one-step staleness.
"""

from __future__ import annotations

import argparse
import json
import sys

from local_runs import swarm_local_json  # scripts/, the script's own folder

MODES = {
    "exact": ["--sync", "exact"],
    "async": ["--sync", "async"],
    "stale": ["--sync", "async", "--no-predict-params"],
}


def run(mode: str, steps: int, extra: list[str]) -> dict:
    args = [*MODES[mode], "--steps", str(steps), *extra]
    print(f"swarm local {' '.join(args)} ...", file=sys.stderr, flush=True)
    return swarm_local_json(args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stale", action="store_true", help="also run async without look-ahead")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("extra", nargs="*", help="more `swarm local` arguments (after --)")
    args = parser.parse_args()
    modes = ("exact", "async", "stale") if args.stale else ("exact", "async")
    results = {mode: run(mode, args.steps, args.extra) for mode in modes}
    exact, asyn = results["exact"], results["async"]
    out = {
        "steps": args.steps,
        "samples": {m: r["samples"] for m, r in results.items()},
        "val_loss": {m: r["val_loss"] for m, r in results.items()},
        "samples_per_s": {m: r["samples_per_s"] for m, r in results.items()},
        "async_val_loss_rel": asyn["val_loss"] / exact["val_loss"] - 1,
        "async_speedup": asyn["samples_per_s"] / exact["samples_per_s"],
    }
    if "stale" in results:
        out["stale_val_loss_rel"] = results["stale"]["val_loss"] / exact["val_loss"] - 1
        out["stale_speedup"] = results["stale"]["samples_per_s"] / exact["samples_per_s"]
    print(f"{'mode':<7}{'samples':>9}{'val_loss':>10}{'samples/s':>11}")
    for mode, r in results.items():
        print(f"{mode:<7}{r['samples']:>9}{r['val_loss']:>10.4f}{r['samples_per_s']:>11.1f}")
    print(f"async vs exact: val loss {100 * out['async_val_loss_rel']:+.2f}%, samples/s x{out['async_speedup']:.2f}")
    if "stale" in results:
        rel, speed = out["stale_val_loss_rel"], out["stale_speedup"]
        print(f"async without look-ahead vs exact: val loss {100 * rel:+.2f}%, samples/s x{speed:.2f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
