"""The compute side of a peer: one thread that owns the stage's module, batches concurrent requests,
accumulates gradients (swarm.peer.executor.accumulators) and applies optimizer steps
(swarm.peer.executor.updates).

All access to parameters, gradient accumulators and the optimizer happens on this one thread, so a
step never races a backward (a cheap forward may run on the event loop instead, never at the same
time: swarm.peer.executor.thread). The gRPC side submits work and awaits the returned futures; `call`
runs any function between batches (state snapshots, updates, the look-ahead's mates' sums).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import math
import time
from dataclasses import asdict

import torch

from swarm.core.checks import abs_bound, all_finite
from swarm.core.errors import InputNotKept, NonFiniteResult, RequestInvalid
from swarm.peer.executor.accumulators import Accumulators, ReducedShard
from swarm.peer.executor.activations import ActivationCache, Kept, saved_bytes
from swarm.peer.executor.lookahead import LookAhead
from swarm.peer.executor.tasks import BACKWARD, EVAL, FORWARD, BackwardResult, ForwardResult, Task
from swarm.peer.executor.thread import ComputeThread
from swarm.peer.executor.updates import ExecutorCounters, StageUpdates
from swarm.peer.ledger import StageLedger
from swarm.policy.ledger import Held
from swarm.training.config import OptimConfig
from swarm.training.models import BuiltStage
from swarm.training.optim import build_optimizer

logger = logging.getLogger(__name__)


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    return b if a is None else a if b is None else a + b


class StageExecutor(StageUpdates, ComputeThread):
    def __init__(
        self,
        built: BuiltStage,
        optim: OptimConfig,
        device: torch.device | str = "cpu",
        max_batch_samples: int = 256,
        predict_params: bool = False,
        prior_samples: int = 8,
        ledger: StageLedger | None = None,
        max_queue_tasks: int = 4096,
        max_queue_bytes: int = 1 << 30,
        activation_budget_bytes: int = 0,
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
        self.lie = None  # debug only (swarm.core.debug.LiePlan): a dishonest peer
        self.predict_params = predict_params
        self.lookahead = LookAhead(self.optimizer, optim, self.params, prior_samples)
        self.activations = ActivationCache(activation_budget_bytes)  # forwards kept for their backward
        self.averaging_step: int | None = None  # the update this peer's stepper is averaging now
        self.reduced_shard: ReducedShard | None = None  # its latest shard of a reduce-scatter (mates fetch it)
        self.counters = ExecutorCounters()
        self.throughput_ema: float | None = None  # samples/s of forward+backward work, measured
        # every applied update and the contributions it holds: travels with the state, so that a
        # peer that downloads it knows which of its own gradients are already in it
        # (`is None`: an empty ledger is falsy, and `or` dropped the given one with its --ledger-dir file)
        self.ledger = ledger if ledger is not None else StageLedger(built.stage)
        self.fingerprint = self.compute_fingerprint()  # (step, sum, sum of |p|), replaced whole

        self.stage_label = f"stage {built.stage}"
        self.forward_s_per_sample: float | None = None  # measured; decides which forwards run inline
        self._start_thread(f"stage{built.stage}-compute", max_queue_tasks, max_queue_bytes)

    # ---- read by other threads ----

    @property
    def accumulating_step(self) -> int:
        return self.acc.accumulating_step

    @property
    def samples_accumulated(self) -> int:
        """Samples held for the next update to apply (`step`), frozen for averaging or not."""
        return self.acc.samples_for(self.step)

    def counters_dict(self) -> dict[str, int | float]:
        counters = {**asdict(self.counters), **asdict(self.lookahead.counters), **asdict(self.activations.counters)}
        return {**counters, "inline_forwards": self.inline_tasks}

    # ---- submission (any thread) ----

    def forward(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor | None = None,
        validation: bool = False,
        tag: int = 0,
        key: str = "",
        inline: bool = False,
        reference: bool = False,
        kept_token: int = 0,
    ) -> concurrent.futures.Future:
        """`key`: a training forward's id, under which its activations may be kept for its backward
        (with `kept_token`, for a backward that leaves its input out). `inline`: a cheap forward may
        run on this thread (swarm.peer.executor.thread). `reference`: a spot check's answer, at the
        applied parameters (no look-ahead), kept for no backward."""
        key = "" if reference else key
        kind = EVAL if validation else FORWARD
        task = Task(kind, inputs, targets, request_id=key, tag=tag, reference=reference, kept_token=kept_token)
        return self.submit_or_run(task, inline)

    def backward(
        self,
        inputs: torch.Tensor | None,
        grad_output: torch.Tensor | None,
        targets: torch.Tensor | None,
        request_id: str,
        tag: int = 0,
        digest: int = 0,
        check_only: bool = False,
        forward_key: str = "",
        reference: bool = False,
        kept_token: int = 0,
        samples: int = 0,
    ) -> concurrent.futures.Future:
        """Accumulate the gradient of (inputs, grad_output or targets) into update `tag`, once per
        `request_id` (a contribution part id). `check_only`: a trainer's spot check of a mate's answer:
        the input gradient only, nothing accumulated. `forward_key`: the forward of this microbatch,
        whose kept activations spare the recompute if this peer ran it. `reference` (with
        `check_only`): at the applied parameters, no look-ahead. `inputs` None: the backward of the
        forward kept under `forward_key` and `kept_token`, of `samples` samples, or InputNotKept."""
        task = Task(
            BACKWARD, inputs, targets, grad_output, request_id, tag, digest=digest, check_only=check_only,
            forward_key=forward_key, reference=reference and check_only, kept_token=kept_token, samples=samples,
        )  # fmt: skip
        return self.submit(task)

    # ---- compute thread ----

    def _is_duplicate(self, task: Task) -> bool:
        """A backward that accumulates nothing (a duplicate, or a spot check): it runs alone."""
        return task.kind == BACKWARD and (task.check_only or self.acc.holder_of(task.request_id) is not None)

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

    def _parameters_for(self, step: int, gradient_samples: int = 0, reference: bool = False):
        """Compute a microbatch whose gradient goes into update `step` at the parameters expected just
        before that update: the current ones if `step` is the next update to apply (or for a
        `reference` answer), else (async look-ahead) the pending update applied with the expected
        mean gradient. A context manager; yields whether the parameters are a prediction."""
        ahead = self.predict_params and step > self.step and not reference
        own = self.acc.pending(self.step) if ahead else None
        if not ahead:
            return contextlib.nullcontext(False)
        return self.lookahead.parameters_for(own, self.step, gradient_samples)

    def _keeps_activations(self, step: int) -> bool:
        """Whether work for update `step` runs at the current parameters, the only ones a kept graph
        can hold (a prediction's parameters are swapped in for one batch, and the cache is cleared
        whenever the parameters change)."""
        return self.activations.enabled and not self.is_last and not (self.predict_params and step > self.step)

    def _forward_kept(self, task: Task) -> tuple[torch.Tensor, bool]:
        """One training forward with its graph, kept under the task's key for its backward; and
        whether it was kept (not when it alone is over the budget)."""
        x = task.inputs.to(self.device, non_blocking=True)
        if self.inputs_are_float:
            x = x.detach().requires_grad_(True)
        hooks, saved = saved_bytes(self.params)
        with torch.enable_grad(), hooks:
            out = self._call_module(x, None)
        kept_bytes = saved[0] + out.numel() * out.element_size() + x.numel() * x.element_size()
        kept = self.activations.put(task.request_id, x, out, kept_bytes, task.kept_token)
        return out.detach(), kept

    def _run_forward(self, tasks: list[Task], train: bool) -> None:
        start = time.perf_counter()
        self.module.train(train)
        step = max(tasks[0].tag, self.acc.accumulating_step) if train else 0
        predicted, kept = False, [False] * len(tasks)
        if train and self._keeps_activations(step) and any(t.request_id for t in tasks):
            # one graph per microbatch: its backward comes alone
            parts, kept = zip(*(self._forward_kept(t) for t in tasks), strict=True)
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            x = self._cat([t.inputs for t in tasks])
            targets = self._cat([t.targets for t in tasks]) if self.is_last else None
            with torch.no_grad(), self._parameters_for(step, 0, tasks[0].reference) as predicted:
                out = self._call_module(x, targets)
        if not all_finite(out):
            raise NonFiniteResult(f"stage {self.built.stage} produced NaN or infinity in its forward pass")
        out = out.detach().cpu()
        elapsed = time.perf_counter() - start
        self.counters.compute_seconds += elapsed
        total = sum(t.size for t in tasks)
        per_sample = elapsed / max(1, total)
        ema = self.forward_s_per_sample
        self.forward_s_per_sample = per_sample if ema is None else 0.9 * ema + 0.1 * per_sample
        offset = 0
        for task, was_kept in zip(tasks, kept, strict=True):
            part = out[offset : offset + task.size]
            offset += task.size
            share = elapsed * task.size / max(1, total)
            output, loss = (None, part) if self.is_last else (part, None)
            task.future.set_result(ForwardResult(output, loss, share, self.step, predicted, was_kept))

    def _gradients(self, tasks: list[Task], target_step: int, duplicate: bool):
        """(parameter gradients, input gradient, per-sample losses, bound on |gradient elements|,
        whether computed at predicted parameters) of one batch, recomputing its forward from the
        inputs the requests carry."""
        x = self._cat([t.inputs for t in tasks])
        targets = self._cat([t.targets for t in tasks]) if self.is_last else None
        grad_out = None if self.is_last else self._cat([t.grad_output for t in tasks])
        if self.inputs_are_float:
            x = x.detach().requires_grad_(True)
        self.module.train(True)
        samples = 0 if duplicate else x.shape[0]
        with torch.enable_grad(), self._parameters_for(target_step, samples, tasks[0].reference) as predicted:
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
        return param_grads, grad_input, losses, self._check_gradients(param_grads, grad_input), predicted

    def _gradients_kept(self, task: Task, kept: Kept):
        """The same from a kept forward: the backward pass only."""
        grad_out = task.grad_output.to(self.device, non_blocking=True)
        wrt = self.params + ([kept.inputs] if self.inputs_are_float else [])
        with torch.enable_grad():
            grads = torch.autograd.grad(kept.output, wrt, grad_outputs=grad_out, allow_unused=True)
        param_grads = list(grads[: len(self.params)])
        grad_input = grads[-1] if self.inputs_are_float else None
        return param_grads, grad_input, None, self._check_gradients(param_grads, grad_input), False

    def _check_gradients(self, param_grads: list[torch.Tensor | None], grad_input: torch.Tensor | None) -> float:
        """NonFiniteResult unless every gradient is finite; a bound on the |elements| of the parameters' (abs_bound)."""
        largest = abs_bound(param_grads)
        if not math.isfinite(largest):
            raise NonFiniteResult(f"stage {self.built.stage} computed a NaN or infinite gradient; not accumulated")
        if grad_input is not None and not all_finite(grad_input):
            raise NonFiniteResult(f"stage {self.built.stage} computed a NaN or infinite input gradient")
        return largest

    def _backward_groups(
        self, tasks: list[Task], target_step: int, duplicate: bool
    ) -> list[tuple[list[Task], Kept | None]]:
        """The batch split into microbatches whose kept forward this peer holds (each alone) and the
        rest (recomputed together). A task without inputs whose kept forward is not here is answered
        InputNotKept and left out (a batch holds such tasks only: their batch key)."""
        if duplicate:
            return [(tasks, None)]
        keeps = self._keeps_activations(target_step)  # not at predicted parameters: nothing kept there
        groups: list[tuple[list[Task], Kept | None]] = []
        recompute: list[Task] = []
        for task in tasks:
            kept = None
            if task.forward_key and keeps:
                kept = self.activations.take(task.forward_key, task.inputs, task.kept_token, task.samples)
            elif task.forward_key:
                self.activations.counters.activation_misses += 1
            if kept is not None and task.grad_output.shape != kept.output.shape:  # fails this task only
                shapes = f"{tuple(task.grad_output.shape)} for an output of {tuple(kept.output.shape)}"
                task.future.set_exception(RequestInvalid(f"{self.stage_label}: grad_output of shape {shapes}"))
            elif kept is not None:
                groups.append(([task], kept))
            elif task.inputs is not None:
                recompute.append(task)
            else:
                where = f"kept forward {task.forward_key}" if keeps else f"forward kept for update {target_step}"
                task.future.set_exception(InputNotKept(f"{self.stage_label} holds no {where} for this backward"))
        return groups + ([(recompute, None)] if recompute else [])

    def _run_backward(self, tasks: list[Task]) -> None:
        start = time.perf_counter()
        check_only = tasks[0].check_only  # such a task runs alone
        holder = self.acc.holder_of(tasks[0].request_id) if len(tasks) == 1 and not check_only else None
        duplicate = holder is not None or check_only
        if duplicate and tasks[0].inputs is None:  # its input gradient is recomputed: that needs the input
            raise InputNotKept(f"{self.stage_label}: a repeated backward without its input")
        # a duplicate still returns its input gradient (the trainer's backward goes on to the earlier
        # stages); a new contribution must be for an update this peer has not frozen or applied
        target_step = max(tasks[0].tag, self.acc.accumulating_step) if duplicate else self.acc.target_step(tasks[0].tag)
        answers: list[tuple[Task, torch.Tensor | None, torch.Tensor | None]] = []
        total: list[torch.Tensor | None] | None = None  # the batch's parameter gradients, summed over groups
        bound = 0.0  # no element of `total` is larger: the groups' largest |elements| summed
        predicted = False  # any group computed at look-ahead parameters
        groups = self._backward_groups(tasks, target_step, duplicate)
        tasks = [t for group, _ in groups for t in group]  # less those answered InputNotKept
        if not tasks:
            return
        for group, kept in groups:
            if kept is None:
                param_grads, grad_input, losses, largest, ahead = self._gradients(group, target_step, duplicate)
            else:
                param_grads, grad_input, losses, largest, ahead = self._gradients_kept(group[0], kept)
            bound += largest
            predicted = predicted or ahead
            total = param_grads if total is None else [_plus(a, b) for a, b in zip(total, param_grads, strict=True)]
            grad_input = None if grad_input is None else grad_input.detach().cpu()
            losses = None if losses is None else losses.cpu()
            offset = 0
            for task in group:
                sl = slice(offset, offset + task.size)
                offset += task.size
                answers.append(
                    (task, None if grad_input is None else grad_input[sl], None if losses is None else losses[sl])
                )
        if not duplicate:  # one add for the whole batch: all of it is accumulated, or (an error) none
            held = {t.request_id or f"anonymous-{id(t)}": Held(t.size, t.digest) for t in tasks}
            self.acc.add(target_step, total or [], held, largest=bound)
        n = sum(t.size for t in tasks)
        elapsed = time.perf_counter() - start
        self._record(n, elapsed)
        if check_only:
            self.counters.check_samples += n
        elif duplicate:
            self.counters.duplicate_samples += n
        # a contribution already applied here is in that update's ledger entry (the trainer releases its
        # record once it reads it there: a later step's entries never list it)
        applied = self.acc.applied_step(tasks[0].request_id) if holder is not None else None
        reported = target_step if applied is None else applied
        for task, grad_input, losses in answers:
            share = elapsed * task.size / max(1, n)
            task.future.set_result(
                BackwardResult(
                    grad_input, losses, reported, duplicate, share, self.acc.epoch, holder, self.step, predicted
                )
            )
