"""One `swarm chaos` run: start a local swarm, train fault-free for the baseline, then inject faults
for the chaos phase, stop the trainers, check the ledger and that nothing was left running.

Throughput is measured from the global step the trainers report: steps x global batch / seconds,
for each phase of the same swarm."""

from __future__ import annotations

import json
import logging
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

from swarm.chaos.config import ChaosOptions
from swarm.chaos.faults import FAULTS, FaultContext
from swarm.chaos.observer import LabObserver, LocalObserver
from swarm.core.procs import group_alive
from swarm.ledger import check_run, read_ledger_dir, read_sample_logs
from swarm.local import LocalOptions, LocalSwarm
from swarm.policy.ledger import LedgerEntry, format_report
from swarm.training.config import RunConfig

logger = logging.getLogger(__name__)

STEP_WAIT_S = 300.0
REAP_WAIT_S = 20.0
SUMMARY_WAIT_S = 240.0
# a scheduled fault that found no victim is tried again this often (until the next one is due)
RETRY_S = 0.5


class StepWatch:
    """The global step from the trainers' progress lines."""

    def __init__(self) -> None:
        self.step = 0
        self.cond = threading.Condition()

    def __call__(self, proc, line: str, payload: dict | None) -> None:
        if payload and payload.get("event") == "progress":
            with self.cond:
                self.step = max(self.step, int(payload["step"]))
                self.cond.notify_all()

    def wait(self, step: int, timeout_s: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: self.step >= step, timeout_s):
                raise TimeoutError(f"training did not reach step {step} within {timeout_s:.0f} s")


@dataclass
class Phase:
    seconds: float
    steps: int

    def samples_per_s(self, global_batch: int) -> float:
        return self.steps * global_batch / self.seconds if self.seconds > 0 else 0.0


def _measure(watch: StepWatch, seconds: float, during=None) -> Phase:
    """Steps the swarm applies in `seconds` (calling `during(deadline)` meanwhile, if given)."""
    start_step, start = watch.step, time.monotonic()
    deadline = start + seconds
    if during is not None:
        during(deadline)
    while time.monotonic() < deadline:
        time.sleep(min(0.5, deadline - time.monotonic()))
    return Phase(time.monotonic() - start, watch.step - start_step)


def _fault_times(opts: ChaosOptions, rng: random.Random, seconds: float) -> list[tuple[float, str | None]]:
    """(seconds into the chaos phase, kind or None: draw one) of every fault."""
    if opts.schedule:
        gap = seconds / (len(opts.schedule) + 1)
        return [(gap * (i + 1), kind) for i, kind in enumerate(opts.schedule)]
    out, t = [], rng.expovariate(1.0 / opts.mtbf_s)
    while t < seconds:
        out.append((t, None))
        t += rng.expovariate(1.0 / opts.mtbf_s)
    return out


def _inject(ctx: FaultContext, times: list[tuple[float, str | None]], start: float, deadline: float) -> None:
    """Each fault at its time. A scheduled kind (`--schedule`) that finds no victim now (e.g. every stage
    with two serving peers has one held or not yet replaced) is tried again until the next fault is due:
    a schedule names faults that must happen, and on a loaded machine a replacement joins later."""
    for i, (at, kind) in enumerate(times):
        while time.monotonic() < start + at:
            time.sleep(min(0.2, start + at - time.monotonic()))
        if time.monotonic() >= deadline:
            return
        retry_until = min(deadline, start + times[i + 1][0]) if kind and i + 1 < len(times) else deadline
        while not _inject_one(ctx, kind, start):
            if not kind or time.monotonic() + RETRY_S >= retry_until:  # retry_until <= deadline
                break
            time.sleep(RETRY_S)


def _inject_one(ctx: FaultContext, kind: str | None, start: float) -> bool:
    """One fault of `kind` (or of the first kind, in random order, that finds a victim): whether one happened."""
    kinds = [kind] if kind else ctx.rng.sample(ctx.opts.kinds, len(ctx.opts.kinds))
    with ctx.lock:
        for k in kinds:
            what = FAULTS[k](ctx)
            if what is not None:
                ctx.counts[k] += 1
                at = f"{time.strftime('%H:%M:%S')} t={time.monotonic() - start:6.1f}s"
                print(f"chaos {at}  {k:<11} {what}", file=sys.stderr, flush=True)
                return True
    return False


def _leftovers(swarm: LocalSwarm) -> int:
    """Process groups of this run still alive after it stopped (hivemind's p2pd included)."""
    groups = [p.pgid for p in swarm.all_processes()]
    deadline = time.monotonic() + REAP_WAIT_S
    while any(group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sum(1 for g in groups if group_alive(g))


def run_chaos(chaos: ChaosOptions, local: LocalOptions, run: RunConfig) -> dict:
    """The whole run; returns the result document (see the module's caller, swarm.cli)."""
    t0 = time.monotonic()
    chaos.resolve_kinds(bool(local.netns))
    rng = random.Random(chaos.chaos_seed)
    watch = StepWatch()
    local.steps = 10**6  # the trainers run until stopped
    swarm = LocalSwarm(local)
    logs = str(swarm.log_dir / "samples-{trainer}.jsonl")
    local.trainer_args = [*local.trainer_args, "--sample-log", logs]
    local.peer_args = [*local.peer_args, "--ledger-dir", str(swarm.log_dir / "ledger")]
    with swarm:
        swarm.start()
        initial = len(swarm.peers)
        swarm.start_trainers(on_line=watch)
        watch.wait(2, STEP_WAIT_S)
        print(f"chaos: fault-free phase for {chaos.baseline_minutes:.1f} min", file=sys.stderr, flush=True)
        baseline = _measure(watch, 60 * chaos.baseline_minutes)
        observer = LocalObserver()
        if swarm.lab is not None:  # the swarm's addresses exist only in the lab: look from a host of it
            observer = LabObserver(swarm.lab.host("chaos", "observer").wrap, str(swarm.log_dir / "observer.log"))
        ctx = FaultContext(swarm, chaos, rng, initial, Counter(), observer=observer)
        times = _fault_times(chaos, rng, 60 * chaos.minutes)
        print(f"chaos: {len(times)} faults in {chaos.minutes:.1f} min", file=sys.stderr, flush=True)
        phase = _measure(watch, 60 * chaos.minutes, lambda d: _inject(ctx, times, time.monotonic(), d))
        ctx.cancel_timers()
        with ctx.lock:
            summaries = _stop_trainers(swarm)
        run_now, entries = _collect(swarm, observer)
        observer.close()
    entries += read_ledger_dir(swarm.log_dir / "ledger")
    report = check_run(run_now or run, entries, read_sample_logs([str(swarm.log_dir / "samples-*.jsonl")]))
    print(format_report(report), file=sys.stderr, flush=True)
    return _result(ctx, run, report, baseline, phase, summaries, _leftovers(swarm), time.monotonic() - t0)


def _stop_trainers(swarm: LocalSwarm) -> list[dict]:
    """SIGTERM the trainers: they stop, validate (trainer 0) and print their summaries."""
    for proc in swarm.trainers:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
    out = []
    for proc in swarm.trainers:
        try:
            proc.wait(timeout=SUMMARY_WAIT_S)
        except Exception:  # noqa: BLE001 - reported as a missing summary
            logger.warning("%s did not stop in time", proc.name)
        if proc.summary is not None:
            out.append(proc.summary)
    return out


def _collect(swarm: LocalSwarm, observer) -> tuple[RunConfig | None, list[LedgerEntry]]:
    try:
        got = observer.collect(swarm.run_id, swarm.join_addresses(), swarm.run_key, swarm.invite)
        return RunConfig.from_json(got["run"]), [LedgerEntry.from_json(e) for e in got["entries"]]
    except Exception as e:  # noqa: BLE001 - the ledger files are read anyway
        logger.warning("reading the live peers' ledgers failed: %s", e)
        return None, []


def _result(ctx, run, report, baseline: Phase, phase: Phase, summaries, leftovers: int, wall_s: float) -> dict:
    sps, base = phase.samples_per_s(run.global_batch), baseline.samples_per_s(run.global_batch)
    val = next((s["val_loss"] for s in summaries if s.get("val_loss") is not None), None)
    counts = report.counts()
    return {
        "faults": dict(sorted(ctx.counts.items())),
        "steps": report.through_step,
        "samples": report.checked_samples,
        "lost": counts["lost"],
        "duplicated": counts["duplicated"],
        "misplaced": counts["misplaced"],
        "ledger_ok": report.passed,
        "samples_per_s": round(sps, 3),
        "fault_free_samples_per_s": round(base, 3),
        "throughput_ratio": round(sps / base, 3) if base else None,
        "val_loss": val,
        "leftover_processes": leftovers,
        "wall_s": round(wall_s, 1),
        "ledger": counts,
    }


def print_result(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result), flush=True)
        return
    for key, value in result.items():
        print(f"{key:>26}: {value}")
