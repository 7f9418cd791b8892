#!/usr/bin/env python
"""Fuzz what a peer parses from the outside (docs/FUZZING.md): the wire decoder, request messages,
every RPC handler of a real in-process StageService, DHT records, states and checkpoints, blobs and
ledger lines.

    .venv/bin/python scripts/fuzz.py --cases 100000 --seed 1 [--target NAME ...] [--out run.json]

The cases are split over the targets by weight. Each target runs in a child process of its own under
an address-space limit (a huge allocation fails instead of swapping the machine) and a watchdog (a
case past --hard-deadline ends the child; the run records the hang and goes on with a new child).
Progress goes to stderr; the last stdout line is one JSON object: cases per target, failures (0 when
every contract held), the distinct violations, wall_s and rss_growth_mb (the largest growth of a
target's peak RSS after its warm-up). Exit status 1 when any case failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fuzz import harness  # noqa: E402
from tests.fuzz.targets import TARGETS, split_cases  # noqa: E402

MAX_RESTARTS = 3  # new children for one target after hangs or crashes


def run_child(name: str, cases: int, seed: int, hard_deadline_s: float) -> None:
    """One target in this process; JSON lines on stdout: progress per batch, then the result."""
    logging.basicConfig(level=logging.CRITICAL)  # thousands of refused inputs are logged otherwise
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # hivemind's own handler: unknown msgpack types
    warnings.filterwarnings("ignore", module="torch")  # odd pickle protocols in random checkpoints
    target = TARGETS[name]
    watchdog = harness.Watchdog(name, hard_deadline_s)

    def progress(result: harness.TargetResult) -> None:
        print(json.dumps({"progress": name, "cases": result.cases, "failures": result.failures}), flush=True)

    with harness.address_space_limit():
        result = harness.run_target(target, cases, seed, watchdog=watchdog, progress=progress)
    print(json.dumps({"result": result.summary()}), flush=True)


class TargetRun:
    """A target's cases over one or more children (a hang or crash ends one; the next goes on)."""

    def __init__(self, name: str, cases: int, seed: int) -> None:
        self.name, self.cases, self.seed = name, cases, seed
        self.done, self.summaries, self.lost = 0, [], []

    def run(self, hard_deadline_s: float) -> None:
        for attempt in range(MAX_RESTARTS + 1):
            left = self.cases - self.done
            if left <= 0:
                return
            seed = self.seed + 7919 * attempt
            command = [sys.executable, __file__, "--child", self.name, "--cases", str(left), "--seed", str(seed)]
            command += ["--hard-deadline", str(hard_deadline_s)]
            if self._child(command, left):
                return
        self.lost.append({"signature": f"stopped after {MAX_RESTARTS + 1} children", "count": 1, "example": ""})

    def _child(self, command: list[str], left: int) -> bool:
        """Run one child; True if it finished its cases."""
        started, base = time.monotonic(), self.done
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=ROOT) as child:
            last: dict = {}
            for line in child.stdout:
                try:
                    last = json.loads(line)
                except ValueError:
                    continue
                if "progress" in last:
                    self.done = base + last["cases"]
                    rate = last["cases"] / max(1e-9, time.monotonic() - started)
                    print(f"[fuzz] {self.name}: {self.done}/{self.cases} cases, {last['failures']} failures, "
                          f"{rate:.0f} cases/s", file=sys.stderr, flush=True)  # fmt: skip
                elif "result" in last:
                    self.summaries.append(last["result"])
                    self.done = base + last["result"]["cases"]
        if "result" in last:
            return True
        what = "hang" if "hang" in last else f"crash (exit status {child.returncode})"
        self.lost.append({"signature": f"{what} of a child", "count": 1, "example": last.get("case", "")})
        self.done = base + last.get("cases", 0) + 1  # the case that hung or crashed counts
        return False

    def summary(self) -> dict:
        violations: dict[str, dict] = {}
        for v in [v for s in self.summaries for v in s["violations"]] + self.lost:
            seen = violations.setdefault(v["signature"], {**v, "count": 0})
            seen["count"] += v["count"]
        outcomes: dict[str, int] = {}
        for s in self.summaries:
            for k, n in s["outcomes"].items():
                outcomes[k] = outcomes.get(k, 0) + n
        return {
            "cases": self.done,
            "failures": sum(v["count"] for v in violations.values()),
            "rss_peak_growth_mb": max((s["rss_peak_growth_mb"] for s in self.summaries), default=0.0),
            "slowest_case_s": max((s["slowest_case_s"] for s in self.summaries), default=0.0),
            "wall_s": round(sum(s["wall_s"] for s in self.summaries), 1),
            "outcomes": outcomes,
            "violations": list(violations.values()),
        }


def report(runs: list[TargetRun], seed: int, wall_s: float) -> dict:
    per = {r.name: r.summary() for r in runs}
    return {
        "cases": sum(s["cases"] for s in per.values()),
        "cases_per_target": {n: s["cases"] for n, s in per.items()},
        "failures": sum(s["failures"] for s in per.values()),
        "failures_per_target": {n: s["failures"] for n, s in per.items()},
        "violations": [
            {"target": n, "signature": v["signature"], "count": v["count"], "example": v["example"][:300]}
            for n, s in per.items()
            for v in s["violations"]
        ],
        "wall_s": round(wall_s, 1),
        "rss_growth_mb": max(s["rss_peak_growth_mb"] for s in per.values()),
        "rss_bound_mb": harness.RUN_RSS_BOUND_MB,
        "case_rss_bound_mb": harness.CASE_RSS_BOUND_MB,
        "address_space_headroom_mb": harness.ADDRESS_SPACE_HEADROOM >> 20,
        "seed": seed,
        "per_target": per,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=100_000, help="cases in all, split over the targets by weight")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="run only this target (repeatable)")
    parser.add_argument("--hard-deadline", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--out", help="also write the full report (with tracebacks) to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child, args.cases, args.seed, args.hard_deadline)
        return 0
    names = args.target or list(TARGETS)
    started = time.monotonic()
    runs = [TargetRun(n, c, args.seed) for n, c in split_cases(args.cases, names).items()]
    for run in runs:
        run.run(args.hard_deadline)
    result = report(runs, args.seed, time.monotonic() - started)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    brief = {k: v for k, v in result.items() if k != "per_target"}
    print(json.dumps(brief))
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
