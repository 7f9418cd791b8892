"""The fuzz harness: run a target's cases, check its contract on each, record what breaks it.

A `Target` is a hypothesis strategy of cases and a `check(case)` that returns an outcome label (how
the code under test answered: "rejected", "INVALID_ARGUMENT", "decoded", ...) or raises on a broken
contract. The check itself catches the documented errors; anything else that escapes it is a
violation, and so is a case slower than the target's deadline or one that raised the process's peak
RSS by more than `CASE_RSS_BOUND_MB`. Violations are recorded by signature (exception type and the
innermost frame in swarm/), with the first failing case and its traceback, and the run goes on: every
case is run, the report lists every distinct bug.

Hard limits around a run: `address_space_limit` lowers RLIMIT_AS so that a huge allocation fails (and
is reported) instead of swapping the machine; `Watchdog` ends the process when one case runs past the
hard deadline (a hang that no exception can interrupt, e.g. a long loop in C++), after printing the
case and every thread's stack.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import random
import resource
import sys
import threading
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

CASE_RSS_BOUND_MB = 64.0  # one case may raise the peak RSS by at most this much
RUN_RSS_BOUND_MB = 256.0  # a whole target run (after its warm-up) by at most this much
ADDRESS_SPACE_HEADROOM = 1 << 30  # RLIMIT_AS: the address space in use at the start plus this
WARMUP_CASES = 100  # cases run before the RSS baseline is taken (lazy imports, kernels, caches)
HANG_EXIT = 70  # exit status of a process the watchdog ended
REPR_LIMIT = 1500
SWARM_DIR = str(Path(__file__).resolve().parents[2] / "swarm")


class ContractViolation(AssertionError):
    """A check's own finding (a wrong status, a broken invariant), as opposed to an escaped error."""


@dataclass
class Target:
    """A fuzz target: cases from `strategy()`, their contract in `check`, fixed `corpus()` cases (found
    bugs and tricky inputs) run first, `weight` its share of a run's cases."""

    name: str
    strategy: Callable[[], st.SearchStrategy]
    check: Callable[[Any], str]
    weight: float = 1.0
    deadline_s: float = 5.0
    corpus: Callable[[], list[Any]] = list
    setup: Callable[[], object] | None = None  # builds the target's fixtures before any case is timed
    # each drawn case is followed by `fanout - 1` cases `derive(case, i)` makes from it (cheap random
    # byte mutations: a mutational fuzzer's fan-out around hypothesis's structured draws); None skips
    fanout: int = 1
    derive: Callable[[Any, random.Random], Any] | None = None


@dataclass
class Violation:
    signature: str
    count: int
    example: str
    trace: str

    def to_json(self) -> dict:
        return {"signature": self.signature, "count": self.count, "example": self.example, "trace": self.trace}


@dataclass
class TargetResult:
    name: str
    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    violations: dict[str, Violation] = field(default_factory=dict)
    slowest_s: float = 0.0
    wall_s: float = 0.0
    rss_baseline_kb: int = 0
    rss_last_peak_kb: int = 0
    rss_peak_growth_mb: float = 0.0

    @property
    def failures(self) -> int:
        return sum(v.count for v in self.violations.values())

    def record(self, signature: str, case: Any, trace: str) -> None:
        seen = self.violations.get(signature)
        if seen is None:
            self.violations[signature] = Violation(signature, 1, short_repr(case), trace[-4000:])
        else:
            seen.count += 1

    def summary(self) -> dict:
        return {
            "target": self.name,
            "cases": self.cases,
            "failures": self.failures,
            "wall_s": round(self.wall_s, 1),
            "slowest_case_s": round(self.slowest_s, 3),
            "rss_peak_growth_mb": round(self.rss_peak_growth_mb, 1),
            "outcomes": dict(self.outcomes.most_common(40)),
            "violations": [v.to_json() for v in self.violations.values()],
        }

    def report(self) -> str:
        """The violations, for an assertion message."""
        lines = [f"{self.name}: {self.failures} contract violations in {self.cases} cases"]
        for v in self.violations.values():
            lines += [f"--- {v.signature} (x{v.count})", f"input: {v.example}", v.trace.rstrip()]
        return "\n".join(lines)


def short_repr(case: Any) -> str:
    text = repr(case)
    return text if len(text) <= REPR_LIMIT else text[:REPR_LIMIT] + f"... ({len(text)} characters)"


def signature_of(error: BaseException) -> str:
    """The exception type and the innermost frame of swarm's own code it went through (else the
    innermost frame): the same bug reached by many inputs has one signature."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(SWARM_DIR)]
    frame = (ours or frames or [None])[-1]
    where = "?" if frame is None else f"{os.path.relpath(frame.filename, Path(SWARM_DIR).parent)}:{frame.lineno}"
    if isinstance(error, ContractViolation):
        return f"contract: {str(error).splitlines()[0][:160]}"
    return f"{type(error).__name__} at {where}"


def peak_rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ---- running cases ----


class CaseRunner:
    """Runs one target's cases: the check, the deadline, the per-case memory bound."""

    def __init__(self, target: Target, result: TargetResult, watchdog: Watchdog | None = None) -> None:
        self.target, self.result, self.watchdog = target, result, watchdog

    def __call__(self, case: Any) -> None:
        self.one(case)
        derive = self.target.derive
        if derive is None or self.target.fanout < 2:
            return
        rng = random.Random(zlib.crc32(short_repr(case).encode()))
        for _ in range(self.target.fanout - 1):
            derived = derive(case, rng)
            if derived is not None:
                self.one(derived)

    def one(self, case: Any) -> None:
        result = self.result
        if self.watchdog is not None:
            self.watchdog.arm(case, result.cases)
        start = time.perf_counter()
        try:
            outcome = self.target.check(case)
        except Exception as e:  # noqa: BLE001 - anything escaping a check is a violation
            result.record(signature_of(e), case, "".join(traceback.format_exception(e)))
            outcome = "violation"
        finally:
            if self.watchdog is not None:
                self.watchdog.disarm()
        elapsed = time.perf_counter() - start
        result.cases += 1
        result.outcomes[outcome] += 1
        result.slowest_s = max(result.slowest_s, elapsed)
        if elapsed > self.target.deadline_s:
            result.record(f"deadline: a case ran over {self.target.deadline_s} s", case, f"took {elapsed:.2f} s")
        self._check_memory(case)
        if result.cases == WARMUP_CASES:
            result.rss_baseline_kb = result.rss_last_peak_kb = peak_rss_kb()

    def _check_memory(self, case: Any) -> None:
        result = self.result
        if not result.rss_baseline_kb:
            return
        peak = peak_rss_kb()
        if (peak - result.rss_last_peak_kb) / 1024 > CASE_RSS_BOUND_MB:
            grew = (peak - result.rss_last_peak_kb) / 1024
            result.record(
                f"memory: one case raised the peak RSS by over {CASE_RSS_BOUND_MB:.0f} MB", case, f"+{grew:.0f} MB"
            )
        result.rss_last_peak_kb = peak
        result.rss_peak_growth_mb = (peak - result.rss_baseline_kb) / 1024


def _hypothesis_batch(strategy: st.SearchStrategy, fn: Callable[[Any], None], cases: int, seed: int) -> None:
    @hypothesis_seed(seed)
    @settings(
        max_examples=cases,
        deadline=None,  # the runner measures each case itself and records the slow ones
        database=None,
        phases=(Phase.generate,),  # no shrinking: the runner never lets a case fail hypothesis
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
    )
    @given(strategy)
    def batch(case: Any) -> None:
        fn(case)

    batch()


def run_target(
    target: Target,
    cases: int,
    seed: int = 0,
    batch_size: int = 500,
    watchdog: Watchdog | None = None,
    progress: Callable[[TargetResult], None] | None = None,
) -> TargetResult:
    """Run `target`'s corpus, then hypothesis cases until `cases` ran in all; never raises for a
    broken contract (see the result's violations)."""
    result = TargetResult(target.name)
    runner = CaseRunner(target, result, watchdog)
    if target.setup is not None:
        target.setup()
    started = time.perf_counter()
    for case in target.corpus():
        runner(case)
    strategy, batch = target.strategy(), 0
    while result.cases < cases:
        before = result.cases
        draws = min(batch_size, -(-(cases - result.cases) // max(1, target.fanout)))  # each makes `fanout` cases
        _hypothesis_batch(strategy, runner, draws, seed * 100_003 + batch)
        batch += 1
        if progress is not None:
            progress(result)
        if result.cases == before:  # the strategy has nothing new to give
            break
    result.wall_s = time.perf_counter() - started
    if result.rss_baseline_kb and result.rss_peak_growth_mb > RUN_RSS_BOUND_MB:
        grew = f"+{result.rss_peak_growth_mb:.0f} MB"
        result.record(f"memory: the run raised the peak RSS by over {RUN_RSS_BOUND_MB:.0f} MB", "(whole run)", grew)
    return result


# ---- hard limits ----


def _address_space_in_use() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def address_space_limit(headroom: int = ADDRESS_SPACE_HEADROOM) -> Iterator[None]:
    """Within the block, an allocation beyond `headroom` more address space fails (torch raises,
    Python raises MemoryError) instead of being served."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space_in_use() + headroom
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


class Watchdog:
    """Ends the process (exit status HANG_EXIT) when a case runs past `hard_deadline_s`, after writing
    the case and every thread's stack to stderr and a JSON line {"hang": ...} to stdout."""

    def __init__(self, target: str, hard_deadline_s: float) -> None:
        self.target, self.hard_deadline_s = target, hard_deadline_s
        self._case: Any = None
        self._index = 0
        self._since: float | None = None
        threading.Thread(target=self._watch, name="fuzz-watchdog", daemon=True).start()

    def arm(self, case: Any, index: int) -> None:
        self._case, self._index, self._since = case, index, time.monotonic()

    def disarm(self) -> None:
        self._since = None

    def _watch(self) -> None:
        while True:
            time.sleep(0.25)
            since = self._since
            if since is not None and time.monotonic() - since > self.hard_deadline_s:
                self._fire()

    def _fire(self) -> None:
        case = short_repr(self._case)
        print(f"[fuzz] {self.target}: case {self._index} ran over {self.hard_deadline_s} s: {case}", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        print(json.dumps({"hang": self.target, "case": case, "cases": self._index}), flush=True)
        sys.stderr.flush()
        os._exit(HANG_EXIT)
