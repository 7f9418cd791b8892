"""Debug and fault-injection hooks, kept out of the roles' production settings.

- `FaultPlan`: torchft-style deterministic fault injection, "fail at this step in this way" (tests
  use it through `swarm peer --debug-fail-at-step N --debug-fail-mode kill|stop|exit|leave`; with
  `--debug-fail-in-request` the fault fires inside the first training request served at that step
  or later, so that a request is in flight when it strikes; with `--debug-fail-in-mate-fetch` it fires
  when a stage-mate fetches this peer's sum of update N-1 or later for averaging, held until this peer
  has applied that update: it dies having applied an update its mate never got its sum for).
- `LiePlan`: a dishonest peer, for the tests of lying-peer detection (`swarm peer --debug-lie outputs`
  perturbs its forward outputs and input gradients; `--debug-lie gradients` scales its contribution to
  the stage's averaging).
- `cpu_profile`: a cProfile of one thread (the peer's event loop: parsing, validation, codecs, gRPC),
  written on exit (`swarm peer --profile-dir DIR`, used by scripts/bench_overheads.py).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FAIL_MODES = ("kill", "stop", "exit", "leave")
LEAVE = "leave"  # the peer daemon's own mode (swarm.peer.daemon): see FaultPlan


@dataclass
class FaultPlan:
    """Fail when the stage reaches `fail_at_step`: SIGKILL self (kill), SIGSTOP self (stop; a test
    resumes it with SIGCONT), exit at once with code 3 (exit), or leave the stage the hard way
    (leave: the compute stops while the peer still looks online to trainers, as in the moment a peer
    starts to leave before its record and Info say so; then it moves to the next stage).

    `in_request`: fire inside the first training request served once the step is reached (before it
    is computed), not from the step loop, so that the fault meets a call in flight: a stopped peer
    leaves the trainer waiting for its deadline, a leaving one answers that request UNAVAILABLE."""

    fail_at_step: int | None = None
    fail_mode: str = "kill"
    in_request: bool = False
    in_mate_fetch: bool = False  # see the module's docstring

    @property
    def at_step_loop(self) -> bool:
        """Whether the step loop fires it (else a request does)."""
        return not (self.in_request or self.in_mate_fetch)

    def __post_init__(self) -> None:
        if self.fail_mode not in FAIL_MODES:
            raise ValueError(f"--debug-fail-mode must be one of {', '.join(FAIL_MODES)}, got {self.fail_mode!r}")

    def due(self, step: int) -> bool:
        return self.fail_at_step is not None and step >= self.fail_at_step

    def inject(self, step: int) -> None:
        """Act now (call when `due`). A stopped process fires once: after SIGCONT it carries on."""
        logger.warning("fault injection: %s at step %d", self.fail_mode, step)
        sys.stderr.flush()
        if self.fail_mode == LEAVE:
            raise ValueError("the leave fault is the peer daemon's to carry out")
        if self.fail_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fail_mode == "stop":
            self.fail_at_step = None
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            os._exit(3)


LIE_MODES = ("outputs", "gradients")


@dataclass
class LiePlan:
    """Lie from update `from_step` on: add noise of `scale` times the answer's RMS to every forward
    output and input gradient (outputs), or scale the averaging contribution by 1 + `scale` (gradients)."""

    mode: str = "outputs"
    scale: float = 0.5
    from_step: int = 0

    def __post_init__(self) -> None:
        if self.mode not in LIE_MODES:
            raise ValueError(f"--debug-lie must be one of {', '.join(LIE_MODES)}, got {self.mode!r}")

    def perturb(self, out, step: int):
        """`out` (a tensor) with noise, when lying about outputs is due at `step`."""
        if self.mode != "outputs" or step < self.from_step or not out.dtype.is_floating_point:
            return out
        import torch

        rms = out.float().pow(2).mean().sqrt().clamp_min(1e-6)
        return out + (self.scale * rms * torch.randn(out.shape)).to(out.dtype)


def add_debug_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("debugging and fault injection (for tests and benchmarks)")
    g.add_argument("--debug-fail-at-step", type=int, metavar="STEP", help="fail when the stage reaches this step")
    g.add_argument("--debug-fail-mode", default="kill", choices=FAIL_MODES, help="how to fail (default kill)")
    g.add_argument(
        "--debug-fail-in-request",
        action="store_true",
        help="fail inside the first training request served at that step or later (a call is in flight)",
    )
    g.add_argument(
        "--debug-fail-in-mate-fetch",
        action="store_true",
        help="fail once this peer has applied an update (step - 1 or later) that a stage-mate is fetching its sum for",
    )
    g.add_argument("--profile-dir", metavar="DIR", help="write a cProfile of the event loop's CPU time here on exit")
    g.add_argument("--debug-lie", choices=LIE_MODES, help="be a dishonest peer (tests of lying-peer detection)")
    g.add_argument("--debug-lie-scale", type=float, default=0.5, help="how much to lie (default 0.5)")
    g.add_argument("--debug-lie-from-step", type=int, default=0, metavar="STEP", help="lie from this update on")


def fault_plan_from_args(args: argparse.Namespace) -> FaultPlan | None:
    if getattr(args, "debug_fail_at_step", None) is None:
        return None
    return FaultPlan(
        args.debug_fail_at_step,
        args.debug_fail_mode,
        in_request=bool(getattr(args, "debug_fail_in_request", False)),
        in_mate_fetch=bool(getattr(args, "debug_fail_in_mate_fetch", False)),
    )


def lie_plan_from_args(args: argparse.Namespace) -> LiePlan | None:
    if getattr(args, "debug_lie", None) is None:
        return None
    return LiePlan(args.debug_lie, args.debug_lie_scale, args.debug_lie_from_step)


@contextlib.contextmanager
def cpu_profile(profile_dir: str | None, name: str) -> Iterator[None]:
    """Profile this thread's CPU time into `profile_dir/name-PID.prof` (no-op without a folder)."""
    if not profile_dir:
        yield
        return
    os.makedirs(profile_dir, exist_ok=True)
    profiler = cProfile.Profile(time.thread_time)
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
        profiler.dump_stats(os.path.join(profile_dir, f"{name}-{os.getpid()}.prof"))
