"""Async look-ahead: microbatches meant for a later update than the next one are computed at the
parameters that update is expected to give, not the current ones.

The expected update is AdamW's step (same schedule, clipping and arithmetic: `optim.predicted_params`)
on the expected mean gradient (`optim.expected_mean_gradient`): the stage's gradients for the pending
update so far (this peer's own and its stage-mates' partial sums, fetched by swarm.peer.partials),
shrunk toward the optimizer's momentum. The prediction is cached per (step, own samples, mates'
samples) and swapped into the parameters only for one batch's compute, on the compute thread: the
real parameters, the fingerprints and the state that other peers download never see it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swarm.peer.executor.accumulators import Accumulated
from swarm.training.config import OptimConfig
from swarm.training.optim import expected_mean_gradient, predicted_params


@dataclass
class LookAheadCounters:
    predicted_samples: int = 0  # samples whose gradient was taken at predicted parameters
    predictions_with_mates: int = 0  # predictions that included mates' gradients
    predicted_with_mates_samples: int = 0  # samples computed at such a prediction


class LookAhead:
    def __init__(
        self, optimizer: torch.optim.Optimizer, optim_cfg: OptimConfig, params: list[torch.Tensor], prior_samples: int
    ) -> None:
        self.optimizer, self.optim_cfg, self.params = optimizer, optim_cfg, params
        self.prior_samples = prior_samples
        self.counters = LookAheadCounters()
        self._prediction: tuple[tuple, list[torch.Tensor]] | None = None  # (cache key, parameters)
        self._mate_partials: dict[str, Accumulated] = {}  # peer id -> its sum for the pending update

    @property
    def mate_partials(self) -> dict[str, Accumulated]:
        return self._mate_partials

    def reset(self) -> None:
        """The pending update was applied (or a state loaded): predictions and mates' sums are stale."""
        self._prediction = None
        self._mate_partials = {}

    def set_mate_partial(self, peer_id: str, partial: Accumulated, pending_step: int) -> bool:
        """Keep a stage-mate's sum for the pending update; a sum for another step is ignored."""
        self._mate_partials = {k: v for k, v in self._mate_partials.items() if v.step == pending_step}
        if partial.step != pending_step:
            return False
        if partial.grads is not None and len(partial.grads) != len(self.params):
            raise ValueError(f"partial gradient has {len(partial.grads)} tensors, the stage {len(self.params)}")
        self._mate_partials[peer_id] = partial
        return True

    @contextlib.contextmanager
    def parameters_for(self, own: Accumulated | None, pending_step: int, gradient_samples: int) -> Iterator[bool]:
        """Swap the predicted parameters of update `pending_step` in for the duration of one batch
        (`own`: this peer's gradients for it); a no-op when nothing can be predicted yet. Yields
        whether it did."""
        predicted = self.predicted(own, pending_step)
        if predicted is None:
            yield False
            return
        self.counters.predicted_samples += gradient_samples
        if len(self._prediction[0][2]) > 0:  # the cache key lists the mates' sums it used
            self.counters.predicted_with_mates_samples += gradient_samples
        saved = [p.data for p in self.params]
        for p, q in zip(self.params, predicted, strict=True):
            p.data = q
        try:
            yield True
        finally:
            for p, d in zip(self.params, saved, strict=True):
                p.data = d

    def predicted(self, own: Accumulated | None, pending_step: int) -> list[torch.Tensor] | None:
        """The parameters after update `pending_step`, from the stage's gradients for it so far,
        cached until they change."""
        samples = 0 if own is None or own.grads is None else own.samples
        mates = sorted(
            (pid, m) for pid, m in self._mate_partials.items() if m.step == pending_step and m.samples and m.grads
        )
        key = (pending_step, samples, tuple((pid, m.samples) for pid, m in mates))
        if self._prediction is None or self._prediction[0] != key:
            self._prediction = None  # free the old copy first
            grad_sum = None if samples == 0 else own.grads
            total = samples + sum(m.samples for _, m in mates)
            if mates:
                self.counters.predictions_with_mates += 1
                grad_sum = [torch.zeros_like(p) for p in self.params] if samples == 0 else [g.clone() for g in grad_sum]
                for _, m in mates:
                    for buf, g in zip(grad_sum, m.grads, strict=True):
                        buf.add_(g.to(buf.device, buf.dtype))
            mean = expected_mean_gradient(self.optimizer, grad_sum, total, self.prior_samples)
            if mean is None:
                return None
            self._prediction = (key, predicted_params(self.optimizer, self.optim_cfg, pending_step, mean))
        return self._prediction[1]
