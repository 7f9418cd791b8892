"""The compute side of a peer: one thread that owns the stage's module, batches concurrent requests,
accumulates gradients (swarm.peer.executor.accumulators) and applies optimizer steps.

All access to parameters, gradient accumulators and the optimizer happens on this one thread, so a
step never races a backward. The gRPC side submits work and awaits the returned futures; `call`
runs any function between batches (state snapshots, updates, the look-ahead's mates' sums).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from swarm.core.checks import all_finite
from swarm.core.errors import ExecutorStopped, NonFiniteResult, RequestInvalid, SwarmError
from swarm.peer.executor.accumulators import Accumulated, Accumulators
from swarm.peer.executor.lookahead import LookAhead
from swarm.peer.executor.tasks import BACKWARD, CALL, EVAL, FORWARD, BackwardResult, ForwardResult, Task, take_batch
from swarm.training.config import OptimConfig
from swarm.training.models import BuiltStage
from swarm.training.optim import apply_update, build_optimizer
from swarm.training.state import clone_tensors, parameter_fingerprint

logger = logging.getLogger(__name__)

# what torch raises on a request the schema let through but the module cannot take
_REQUEST_FAULTS = (ValueError, RuntimeError, IndexError, TypeError)


@dataclass
class ExecutorCounters:
    samples_processed: int = 0  # samples back-propagated
    samples_discarded: int = 0  # own gradients dropped when catching up more than one step
    averaging_rounds: int = 0
    compute_seconds: float = 0.0


class StageExecutor:
    def __init__(
        self,
        built: BuiltStage,
        optim: OptimConfig,
        device: torch.device | str = "cpu",
        max_batch_samples: int = 256,
        predict_params: bool = False,
        prior_samples: int = 8,
    ) -> None:
        self.built = built
        self.device = torch.device(device)
        self.module = built.module.to(self.device)
        self.optim_cfg = optim
        self.optimizer = build_optimizer(self.module, optim)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.max_batch_samples = max_batch_samples
        self.is_last = built.schema.is_last
        self.inputs_are_float = built.schema.input.dtype.is_floating_point

        self.step = 0  # updates applied
        self.acc = Accumulators(self.params)
        self.predict_params = predict_params
        self.lookahead = LookAhead(self.optimizer, optim, self.params, prior_samples)
        self.counters = ExecutorCounters()
        self.throughput_ema: float | None = None  # samples/s of forward+backward work, measured
        # (step, peer ids whose gradients it averaged) of the last applied update: travels with the
        # state so that a peer that downloads it knows whether its own gradient is already in it
        self.last_update: tuple[int, tuple[str, ...]] = (-1, ())
        self.fingerprint = self.compute_fingerprint()  # (step, sum, sum of |p|), replaced whole

        self._queue: collections.deque[Task] = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"stage{built.stage}-compute", daemon=True)
        self._thread.start()

    # ---- read by other threads ----

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    @property
    def accumulating_step(self) -> int:
        return self.acc.accumulating_step

    @property
    def samples_accumulated(self) -> int:
        """Samples held for the next update to apply (`step`), frozen for averaging or not."""
        return self.acc.samples_for(self.step)

    def counters_dict(self) -> dict[str, int | float]:
        return {**asdict(self.counters), **asdict(self.lookahead.counters)}

    # ---- submission (any thread) ----

    def submit(self, task: Task) -> concurrent.futures.Future:
        with self._cv:
            if self._stopped:
                raise ExecutorStopped(f"stage {self.built.stage}'s executor is stopped (leaving or shutting down)")
            self._queue.append(task)
            self._cv.notify()
        return task.future

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None, validation: bool = False, tag: int = 0
    ) -> concurrent.futures.Future:
        return self.submit(Task(EVAL if validation else FORWARD, inputs, targets, tag=tag))

    def backward(
        self,
        inputs: torch.Tensor,
        grad_output: torch.Tensor | None,
        targets: torch.Tensor | None,
        request_id: str,
        tag: int = 0,
    ) -> concurrent.futures.Future:
        return self.submit(Task(BACKWARD, inputs, targets, grad_output, request_id, tag))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the compute thread, between batches: safe access to parameters and state."""
        return self.submit(Task(CALL, fn=fn))

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            pending = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for task in pending:
            if not task.future.done():
                task.future.set_exception(ExecutorStopped(f"stage {self.built.stage}'s executor stopped"))
        self._thread.join(timeout=10)

    # ---- compute thread ----

    def _is_duplicate(self, task: Task) -> bool:
        return task.kind == BACKWARD and self.acc.is_duplicate(task.request_id)

    def _next_batch(self) -> list[Task] | None:
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            return take_batch(self._queue, self.acc, self.max_batch_samples, self._is_duplicate)

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            live = [t for t in batch if t.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                kind = live[0].kind
                if kind == CALL:
                    live[0].future.set_result(live[0].fn())
                elif kind == BACKWARD:
                    self._run_backward(live)
                else:
                    self._run_forward(live, train=kind == FORWARD)
            except BaseException as e:  # noqa: BLE001 - every error goes back to its requester
                if kind != CALL and isinstance(e, _REQUEST_FAULTS) and not isinstance(e, SwarmError):
                    e = RequestInvalid(f"{type(e).__name__}: {e}")
                elif not isinstance(e, (SwarmError, *_REQUEST_FAULTS)):
                    logger.exception("unexpected error in the compute thread")
                for task in live:
                    if not task.future.done():
                        task.future.set_exception(e)

    def _cat(self, tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        if tensors[0] is None:
            return None
        t = tensors[0] if len(tensors) == 1 else torch.cat(tensors)
        return t.to(self.device, non_blocking=True)

    def _call_module(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        out = self.module(x, targets) if self.is_last else self.module(x)
        if self.is_last and out.dim() == 0:
            # A custom last stage returning the batch's mean loss: n * mean is the same summed
            # objective; each sample reports the batch mean.
            out = out.expand(x.shape[0])
        return out

    def _record(self, samples: int, seconds: float) -> None:
        self.counters.samples_processed += samples
        self.counters.compute_seconds += seconds
        if seconds > 0:
            rate = samples / seconds
            self.throughput_ema = rate if self.throughput_ema is None else 0.9 * self.throughput_ema + 0.1 * rate

    def _parameters_for(self, step: int, gradient_samples: int = 0):
        """Compute a microbatch whose gradient goes into update `step` at the parameters expected just
        before that update: the current ones if `step` is the next update to apply, else (async
        look-ahead) the pending update applied with the expected mean gradient."""
        ahead = self.predict_params and step > self.step
        own = self.acc.pending(self.step) if ahead else None
        return self.lookahead.parameters_for(own, self.step, gradient_samples) if ahead else contextlib.nullcontext()

    def _run_forward(self, tasks: list[Task], train: bool) -> None:
        start = time.perf_counter()
        x = self._cat([t.inputs for t in tasks])
        targets = self._cat([t.targets for t in tasks]) if self.is_last else None
        self.module.train(train)
        with torch.no_grad(), self._parameters_for(self.acc.target_step(tasks[0].tag) if train else 0):
            out = self._call_module(x, targets)
        if not all_finite(out):
            raise NonFiniteResult(f"stage {self.built.stage} produced NaN or infinity in its forward pass")
        out = out.detach().cpu()
        elapsed = time.perf_counter() - start
        self.counters.compute_seconds += elapsed
        offset = 0
        for task in tasks:
            part = out[offset : offset + task.size]
            offset += task.size
            share = elapsed * task.size / max(1, x.shape[0])
            task.future.set_result(
                ForwardResult(None, part, share) if self.is_last else ForwardResult(part, None, share)
            )

    def _gradients(self, tasks: list[Task], target_step: int, duplicate: bool):
        """(parameter gradients, input gradient, per-sample losses, batch size) of one batch."""
        x = self._cat([t.inputs for t in tasks])
        targets = self._cat([t.targets for t in tasks]) if self.is_last else None
        grad_out = None if self.is_last else self._cat([t.grad_output for t in tasks])
        if self.inputs_are_float:
            x = x.detach().requires_grad_(True)
        self.module.train(True)
        with torch.enable_grad(), self._parameters_for(target_step, 0 if duplicate else x.shape[0]):
            out = self._call_module(x, targets)
            if self.is_last:
                objective, grad_seed, losses = out.sum(), None, out.detach()
                if not all_finite(losses):
                    raise NonFiniteResult(f"stage {self.built.stage} produced a NaN or infinite loss")
            else:
                objective, grad_seed, losses = out, grad_out, None
            wrt = ([] if duplicate else self.params) + ([x] if self.inputs_are_float else [])
            grads = torch.autograd.grad(objective, wrt, grad_outputs=grad_seed, allow_unused=True) if wrt else []
        param_grads = [] if duplicate else list(grads[: len(self.params)])
        grad_input = grads[-1] if self.inputs_are_float else None
        if not all(g is None or all_finite(g) for g in param_grads):
            raise NonFiniteResult(f"stage {self.built.stage} computed a NaN or infinite gradient; not accumulated")
        if grad_input is not None and not all_finite(grad_input):
            raise NonFiniteResult(f"stage {self.built.stage} computed a NaN or infinite input gradient")
        return param_grads, grad_input, losses, x.shape[0]

    def _run_backward(self, tasks: list[Task]) -> None:
        start = time.perf_counter()
        duplicate = len(tasks) == 1 and self._is_duplicate(tasks[0])
        target_step = self.acc.target_step(tasks[0].tag)
        param_grads, grad_input, losses, n = self._gradients(tasks, target_step, duplicate)
        if not duplicate:
            self.acc.add(target_step, param_grads, n, [t.request_id for t in tasks])
        grad_input = None if grad_input is None else grad_input.detach().cpu()
        losses = None if losses is None else losses.cpu()
        elapsed = time.perf_counter() - start
        self._record(n, elapsed)
        offset = 0
        for task in tasks:
            sl = slice(offset, offset + task.size)
            offset += task.size
            share = elapsed * task.size / max(1, n)
            task.future.set_result(
                BackwardResult(
                    None if grad_input is None else grad_input[sl],
                    None if losses is None else losses[sl],
                    target_step,
                    duplicate,
                    share,
                )
            )

    # ---- look-ahead: stage-mates' partial sums (compute thread) ----

    def partial_gradient(self, step: int) -> Accumulated | None:
        """This peer's own gradient sum for the pending update `step` as one flat bfloat16 tensor
        (`grads` holds just that), for its stage-mates' look-ahead; None when `step` is not pending
        here."""
        if step != self.step:
            return None
        acc = self.acc.pending(step)
        if acc is None or acc.grads is None or acc.samples == 0:
            return Accumulated(None, 0, step)
        flat = torch.cat([g.detach().reshape(-1).to(torch.bfloat16) for g in acc.grads]).cpu()
        return Accumulated([flat], acc.samples, step)

    def set_mate_partial(self, peer_id: str, partial: Accumulated) -> bool:
        """Keep a stage-mate's gradient sum for the pending update (the caller checked shapes and
        finiteness); a sum for another step than the pending one is ignored."""
        return self.lookahead.set_mate_partial(peer_id, partial, self.step)

    # ---- updates and state (call these through `call`, or from the compute thread) ----

    def take_accumulated(self) -> Accumulated:
        """Freeze the accumulator of the next update; new gradients go into the one after."""
        return self.acc.freeze()

    def add_to_accumulator(self, frozen: Accumulated, step: int) -> None:
        """Carry a frozen gradient into the accumulator of `step`."""
        self.acc.carry(frozen, step)

    def _step_changed(self, drop_stale: bool) -> None:
        """After the parameters changed to those of `self.step` (an update, or a loaded state)."""
        self.acc.on_step_changed(self.step, drop_stale)
        self.lookahead.reset()
        self.fingerprint = self.compute_fingerprint()

    def apply_mean_gradient(self, mean_grads: list[torch.Tensor], step: int, members: tuple[str, ...] = ()) -> float:
        """Apply the update for `step` from the mean gradient (already averaged across the stage
        from the gradients of `members`)."""
        if step != self.step:
            raise RuntimeError(f"update for step {step} applied at step {self.step}")
        for p, g in zip(self.params, mean_grads, strict=True):
            p.grad = g.to(p.device)
        norm = apply_update(self.optimizer, self.optim_cfg, step)
        for p in self.params:
            p.grad = None
        self.step = step + 1
        self.last_update = (step, tuple(members))
        self._step_changed(drop_stale=False)
        return norm

    def local_step(self) -> tuple[int, float]:
        """Freeze and apply an update from this peer's own gradients (no averaging)."""
        frozen = self.take_accumulated()
        mean = [g / max(1, frozen.samples) for g in frozen.grads]
        return frozen.samples, self.apply_mean_gradient(mean, frozen.step)

    def compute_fingerprint(self) -> tuple[int, float, float]:
        """(step, sum, sum of |p|): replaced as one tuple so that readers on other threads see a
        consistent (step, values)."""
        return (self.step, *parameter_fingerprint(self.params))

    def state_dict(self) -> dict:
        """Parameters, optimizer state and step: what a joining peer downloads."""
        return {
            "step": self.step,
            "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
            "optimizer": clone_tensors(self.optimizer.state_dict()),
            "last_update": {"step": self.last_update[0], "members": list(self.last_update[1])},
        }

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        last = state.get("last_update")
        if isinstance(last, dict) and isinstance(last.get("step"), int) and isinstance(last.get("members"), list):
            self.last_update = (last["step"], tuple(str(m) for m in last["members"]))
        else:  # a checkpoint or peer from before this field: membership unknown
            self.last_update = (self.step - 1, ())
        # gradients computed for updates the loaded state already holds are stale: dropped
        self._step_changed(drop_stale=True)
