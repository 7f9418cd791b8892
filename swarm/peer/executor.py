"""The compute side of a peer: one thread that owns the stage's module, batches concurrent requests,
accumulates gradients and applies optimizer steps.

All access to parameters, gradient accumulators and the optimizer happens on this one thread, so a
step never races a backward. The gRPC side submits work and awaits the returned futures.

Gradient convention: the objective of a microbatch is the SUM over its samples of the per-sample loss.
Accumulators hold that sum's gradient; an update divides by the number of samples it covers, which
makes any split into microbatches, peers and batches compute the same mean gradient.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.core.checks import all_finite
from swarm.training.config import OptimConfig
from swarm.training.models import BuiltStage
from swarm.training.optim import apply_update, build_optimizer, expected_mean_gradient, predicted_params

logger = logging.getLogger(__name__)

FORWARD, BACKWARD, EVAL, CALL = "forward", "backward", "eval", "call"


class NonFiniteError(ValueError):
    """The stage produced NaN or infinity for this request; nothing was accumulated."""


@dataclass
class Task:
    kind: str
    inputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    request_id: str = ""
    tag: int = 0  # forward and backward: the step the trainer meant this microbatch for
    fn: Callable[[], Any] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def size(self) -> int:
        return 0 if self.inputs is None else int(self.inputs.shape[0])

    def batch_key(self, accumulating_step: int) -> tuple:
        x = self.inputs
        t = self.targets
        tag = max(self.tag, accumulating_step) if self.kind in (FORWARD, BACKWARD) else 0
        return (self.kind, x.dtype, tuple(x.shape[1:]), None if t is None else tuple(t.shape[1:]), tag)


@dataclass
class ForwardResult:
    output: torch.Tensor | None  # None on the last stage
    loss: torch.Tensor | None  # per-sample losses on the last stage
    compute_s: float


@dataclass
class BackwardResult:
    grad_input: torch.Tensor | None
    loss: torch.Tensor | None
    accumulated_step: int
    duplicate: bool
    compute_s: float


@dataclass
class Accumulated:
    """A gradient accumulator: the gradient of the summed loss over `samples` samples, for `step`."""

    grads: list[torch.Tensor] | None
    samples: int
    step: int
    request_ids: set[str] = field(default_factory=set)


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
        self.accumulating_step = 0  # the next update to apply; its accumulator is the one counted
        # One accumulator per step: a microbatch the trainer meant for a later step (async mode runs
        # ahead by up to max_staleness steps) waits in its own accumulator, so each update covers
        # exactly the samples meant for it.
        self._acc: dict[int, Accumulated] = {}
        self._frozen: Accumulated | None = None  # taken for averaging, not yet applied
        self._recent_ids: collections.deque[set[str]] = collections.deque(maxlen=4)
        self.samples_discarded = 0
        self.averaging_rounds = 0
        self.fingerprint = self.compute_fingerprint()  # (step, sum, sum of |p|), replaced whole
        # (step, peer ids whose gradients it averaged) of the last applied update: travels with the
        # state so that a peer that downloads it knows whether its own gradient is already in it
        self.last_update: tuple[int, tuple[str, ...]] = (-1, ())
        # async look-ahead: microbatches meant for a later update than the next one are computed at
        # the parameters that update is expected to give (see optim.predicted_params)
        self.predict_params = predict_params
        self.prior_samples = prior_samples
        # (step, own samples, ((mate, samples), ...)) -> parameters predicted from those gradients
        self._prediction: tuple[tuple, list[torch.Tensor]] | None = None
        self.predicted_samples = 0  # samples whose gradient was taken at predicted parameters
        # stage-mates' gradient sums for the pending update (peer id -> sum), fetched by
        # swarm.peer.partials, so that the prediction uses every gradient the stage holds, not only ours
        self._mate_partials: dict[str, Accumulated] = {}
        self.predictions_with_mates = 0  # predictions that included mates' gradients
        self.predicted_with_mates_samples = 0  # samples computed at such a prediction

        self.samples_processed = 0
        self.compute_seconds = 0.0
        self.throughput_ema: float | None = None  # samples/s of forward+backward work, measured

        self._queue: collections.deque[Task] = collections.deque()
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=f"stage{built.stage}-compute", daemon=True)
        self._thread.start()

    # ---- submission (any thread) ----

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    def submit(self, task: Task) -> concurrent.futures.Future:
        with self._cv:
            if self._stopped:
                raise RuntimeError("stage executor is stopped")
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

    @property
    def samples_accumulated(self) -> int:
        """Samples held for the next update to apply (`step`), frozen for averaging or not."""
        frozen = self._frozen
        if frozen is not None and frozen.step == self.step:
            return frozen.samples
        acc = self._acc.get(self.step)
        return 0 if acc is None else acc.samples

    def samples_ahead(self) -> int:
        """Samples accumulated for later updates."""
        return sum(a.samples for step, a in self._acc.items() if step > self.accumulating_step)

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
                task.future.set_exception(RuntimeError("peer is shutting down"))
        self._thread.join(timeout=10)

    # ---- compute thread ----

    def _next_batch(self) -> list[Task] | None:
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            first = self._queue.popleft()
            if first.kind == CALL or (first.kind == BACKWARD and self._is_duplicate(first.request_id)):
                return [first]
            batch, total, key = [first], first.size, first.batch_key(self.accumulating_step)
            keep: list[Task] = []
            while self._queue and total < self.max_batch_samples:
                task = self._queue.popleft()
                if (
                    task.kind != CALL
                    and task.batch_key(self.accumulating_step) == key
                    and total + task.size <= self.max_batch_samples
                    and not (task.kind == BACKWARD and self._is_duplicate(task.request_id))
                ):
                    batch.append(task)
                    total += task.size
                else:
                    keep.append(task)
            self._queue.extendleft(reversed(keep))
            return batch

    def _is_duplicate(self, request_id: str) -> bool:
        if not request_id:
            return False
        return any(request_id in a.request_ids for a in self._acc.values()) or any(
            request_id in s for s in self._recent_ids
        )

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
                if not isinstance(e, (ValueError, RuntimeError, IndexError, TypeError, NonFiniteError)):
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
        self.samples_processed += samples
        self.compute_seconds += seconds
        if seconds > 0:
            rate = samples / seconds
            self.throughput_ema = rate if self.throughput_ema is None else 0.9 * self.throughput_ema + 0.1 * rate

    def _run_forward(self, tasks: list[Task], train: bool) -> None:
        start = time.perf_counter()
        x = self._cat([t.inputs for t in tasks])
        targets = self._cat([t.targets for t in tasks]) if self.is_last else None
        self.module.train(train)
        with torch.no_grad(), self._parameters_for(max(tasks[0].tag, self.accumulating_step) if train else 0):
            out = self._call_module(x, targets)
        if not all_finite(out):
            raise NonFiniteError(f"stage {self.built.stage} produced NaN or infinity in its forward pass")
        out = out.detach().cpu()
        elapsed = time.perf_counter() - start
        self.compute_seconds += elapsed
        offset = 0
        for task in tasks:
            part = out[offset : offset + task.size]
            offset += task.size
            share = elapsed * task.size / max(1, x.shape[0])
            if self.is_last:
                task.future.set_result(ForwardResult(None, part, share))
            else:
                task.future.set_result(ForwardResult(part, None, share))

    def _run_backward(self, tasks: list[Task]) -> None:
        start = time.perf_counter()
        duplicate = len(tasks) == 1 and self._is_duplicate(tasks[0].request_id)
        x = self._cat([t.inputs for t in tasks])
        targets = self._cat([t.targets for t in tasks]) if self.is_last else None
        grad_out = None if self.is_last else self._cat([t.grad_output for t in tasks])
        if self.inputs_are_float:
            x = x.detach().requires_grad_(True)
        target_step = max(tasks[0].tag, self.accumulating_step)
        self.module.train(True)
        with torch.enable_grad(), self._parameters_for(target_step, 0 if duplicate else x.shape[0]):
            out = self._call_module(x, targets)
            if self.is_last:
                objective, grad_seed = out.sum(), None
                losses = out.detach()
                if not all_finite(losses):
                    raise NonFiniteError(f"stage {self.built.stage} produced a NaN or infinite loss")
            else:
                objective, grad_seed, losses = out, grad_out, None
            wrt = ([] if duplicate else self.params) + ([x] if self.inputs_are_float else [])
            grads = torch.autograd.grad(objective, wrt, grad_outputs=grad_seed, allow_unused=True) if wrt else []
        param_grads = [] if duplicate else list(grads[: len(self.params)])
        grad_input = grads[-1] if self.inputs_are_float else None
        for g in param_grads:
            if g is not None and not all_finite(g):
                raise NonFiniteError(f"stage {self.built.stage} computed a NaN or infinite gradient; not accumulated")
        if grad_input is not None and not all_finite(grad_input):
            raise NonFiniteError(f"stage {self.built.stage} computed a NaN or infinite input gradient")
        if not duplicate:
            acc = self._acc.get(target_step)
            if acc is None:
                acc = self._acc[target_step] = Accumulated(None, 0, target_step)
            if acc.grads is None:
                acc.grads = [torch.zeros_like(p) for p in self.params]
            for buf, g in zip(acc.grads, param_grads, strict=True):
                if g is not None:
                    buf.add_(g)
            acc.samples += x.shape[0]
            acc.request_ids.update(t.request_id for t in tasks if t.request_id)
        grad_input = None if grad_input is None else grad_input.detach().cpu()
        losses = None if losses is None else losses.cpu()
        elapsed = time.perf_counter() - start
        self._record(x.shape[0], elapsed)
        offset = 0
        for task in tasks:
            sl = slice(offset, offset + task.size)
            offset += task.size
            task.future.set_result(
                BackwardResult(
                    None if grad_input is None else grad_input[sl],
                    None if losses is None else losses[sl],
                    target_step,
                    duplicate,
                    elapsed * task.size / max(1, x.shape[0]),
                )
            )

    @contextlib.contextmanager
    def _parameters_for(self, step: int, gradient_samples: int = 0) -> Iterator[None]:
        """Compute a microbatch whose gradient goes into update `step` at the parameters expected just
        before that update: the current ones if `step` is the next update to apply, else (async
        look-ahead) the pending update applied with the expected mean gradient."""
        predicted = self._predicted() if self.predict_params and step > self.step else None
        if predicted is None:
            yield
            return
        self.predicted_samples += gradient_samples
        if len(self._prediction[0][2]) > 0:  # the cache key lists the mates' sums it used
            self.predicted_with_mates_samples += gradient_samples
        saved = [p.data for p in self.params]
        for p, q in zip(self.params, predicted, strict=True):
            p.data = q
        try:
            yield
        finally:
            for p, d in zip(self.params, saved, strict=True):
                p.data = d

    def _pending_accumulator(self) -> Accumulated | None:
        """This peer's gradients for the pending update `step`, frozen for averaging or not."""
        frozen = self._frozen
        return frozen if frozen is not None and frozen.step == self.step else self._acc.get(self.step)

    def _predicted(self) -> list[torch.Tensor] | None:
        """The parameters after the pending update `step`, from the stage's gradients for it so far
        (this peer's, frozen for averaging or still accumulating, and its mates' last known sums),
        cached until they change."""
        acc = self._pending_accumulator()
        samples = 0 if acc is None or acc.grads is None else acc.samples
        mates = sorted(
            (pid, m) for pid, m in self._mate_partials.items() if m.step == self.step and m.samples and m.grads
        )
        key = (self.step, samples, tuple((pid, m.samples) for pid, m in mates))
        if self._prediction is None or self._prediction[0] != key:
            self._prediction = None  # free the old copy first
            grad_sum = None if samples == 0 else acc.grads
            total = samples + sum(m.samples for _, m in mates)
            if mates:
                self.predictions_with_mates += 1
                grad_sum = [torch.zeros_like(p) for p in self.params] if samples == 0 else [g.clone() for g in grad_sum]
                for _, m in mates:
                    for buf, g in zip(grad_sum, m.grads, strict=True):
                        buf.add_(g.to(buf.device, buf.dtype))
            mean = expected_mean_gradient(self.optimizer, grad_sum, total, self.prior_samples)
            if mean is None:
                return None
            self._prediction = (key, predicted_params(self.optimizer, self.optim_cfg, self.step, mean))
        return self._prediction[1]

    def partial_gradient(self, step: int) -> Accumulated | None:
        """This peer's own gradient sum for the pending update `step` as one flat bfloat16 tensor
        (`grads` holds just that), for its stage-mates' look-ahead (compute thread only); None when
        `step` is not pending here."""
        if step != self.step:
            return None
        acc = self._pending_accumulator()
        if acc is None or acc.grads is None or acc.samples == 0:
            return Accumulated(None, 0, step)
        flat = torch.cat([g.detach().reshape(-1).to(torch.bfloat16) for g in acc.grads]).cpu()
        return Accumulated([flat], acc.samples, step)

    def set_mate_partial(self, peer_id: str, partial: Accumulated) -> bool:
        """Keep a stage-mate's gradient sum for the pending update (compute thread only). The caller
        checked shapes and finiteness; a sum for another step than the pending one is ignored."""
        self._mate_partials = {k: v for k, v in self._mate_partials.items() if v.step == self.step}
        if partial.step != self.step:
            return False
        if partial.grads is not None and len(partial.grads) != len(self.params):
            raise ValueError(f"partial gradient has {len(partial.grads)} tensors, the stage {len(self.params)}")
        self._mate_partials[peer_id] = partial
        return True

    # ---- steps (call these through `call`, or from the compute thread) ----

    def take_accumulated(self) -> Accumulated:
        """Freeze the accumulator for `accumulating_step`; new gradients go into the next update."""
        frozen = self._acc.pop(self.accumulating_step, None) or Accumulated(None, 0, self.accumulating_step)
        if frozen.grads is None:
            frozen.grads = [torch.zeros_like(p) for p in self.params]
        self._recent_ids.append(frozen.request_ids)
        self.accumulating_step += 1
        self._frozen = frozen
        return frozen

    def add_to_accumulator(self, frozen: Accumulated, step: int) -> None:
        """Carry a frozen gradient into the accumulator of `step` (compute thread only)."""
        acc = self._acc.get(step)
        if acc is None:
            acc = self._acc[step] = Accumulated(None, 0, step)
        if acc.grads is None:
            acc.grads = [g.clone() for g in frozen.grads]
        else:
            for buf, g in zip(acc.grads, frozen.grads, strict=True):
                buf.add_(g)
        acc.samples += frozen.samples
        acc.request_ids |= frozen.request_ids
        if self._frozen is frozen:
            self._frozen = None

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
        self.accumulating_step = max(self.accumulating_step, self.step)
        self._prediction = None
        self._mate_partials = {}  # sums for the update just applied (or skipped)
        if self._frozen is not None and self._frozen.step < self.step:
            self._frozen = None
        self.fingerprint = self.compute_fingerprint()
        return norm

    @torch.no_grad()
    def compute_fingerprint(self) -> tuple[int, float, float]:
        """(step, sum, sum of |p|) of all parameters in float64. Cheap, and any divergence between
        stage-mates (a partial all-reduce, a missed update) moves it far beyond rounding noise.
        Replaced as one tuple so that readers on other threads see a consistent (step, values)."""
        total, absolute = 0.0, 0.0
        for p in self.params:
            flat = p.detach().reshape(-1)
            total += float(flat.sum(dtype=torch.float64))
            absolute += float(flat.abs().sum(dtype=torch.float64))
        return self.step, total, absolute

    def local_step(self) -> tuple[int, float]:
        """Freeze and apply an update from this peer's own gradients (no averaging)."""
        frozen = self.take_accumulated()
        mean = [g / max(1, frozen.samples) for g in frozen.grads]
        return frozen.samples, self.apply_mean_gradient(mean, frozen.step)

    def state_dict(self) -> dict:
        """Parameters, optimizer state and step: what a joining peer downloads (compute thread only)."""
        return {
            "step": self.step,
            "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
            "optimizer": _clone_tensors(self.optimizer.state_dict()),
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
        self.accumulating_step = self.step
        self._prediction = None
        self._mate_partials = {}  # sums for the update just applied (or skipped)
        if self._frozen is not None and self._frozen.step < self.step:
            self._frozen = None
        self.fingerprint = self.compute_fingerprint()
        # gradients computed for steps the loaded state has already applied are stale: drop them
        self._acc = {s: a for s, a in self._acc.items() if s >= self.step}


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    return obj
