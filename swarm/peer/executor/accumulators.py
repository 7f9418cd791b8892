"""A peer's gradient sums, one per update they are meant for.

A microbatch the trainer meant for a later update (async mode runs ahead by up to max_staleness
steps) waits in its own accumulator, so each update covers exactly the samples meant for it. The
accumulator of the next update is frozen while the stage averages it; request ids of recent updates
are remembered so that a retried Backward adds nothing twice. Compute thread only.

Gradient convention: the gradient of the SUM over samples of the per-sample loss; an update divides
by the number of samples it covers.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

RECENT_UPDATES_REMEMBERED = 4  # updates whose request ids still count as duplicates


@dataclass
class Accumulated:
    """The gradient of the summed loss over `samples` samples, for update `step`."""

    grads: list[torch.Tensor] | None
    samples: int
    step: int
    request_ids: set[str] = field(default_factory=set)


class Accumulators:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.accumulating_step = 0  # the next update to freeze; gradients for it and later go in
        self._open: dict[int, Accumulated] = {}
        self.frozen: Accumulated | None = None  # taken for averaging, not yet applied
        self._recent_ids: collections.deque[set[str]] = collections.deque(maxlen=RECENT_UPDATES_REMEMBERED)

    def is_duplicate(self, request_id: str) -> bool:
        if not request_id:
            return False
        return any(request_id in a.request_ids for a in self._open.values()) or any(
            request_id in ids for ids in self._recent_ids
        )

    def target_step(self, tag: int) -> int:
        """The update a microbatch tagged `tag` goes into: its tag, or the open one if that is later
        (the stage already froze or applied the update it was meant for)."""
        return max(tag, self.accumulating_step)

    def add(self, step: int, grads: list[torch.Tensor | None], samples: int, request_ids: list[str]) -> None:
        acc = self._open.get(step)
        if acc is None:
            acc = self._open[step] = Accumulated(None, 0, step)
        if acc.grads is None:
            acc.grads = [torch.zeros_like(p) for p in self.params]
        for buf, g in zip(acc.grads, grads, strict=True):
            if g is not None:
                buf.add_(g)
        acc.samples += samples
        acc.request_ids.update(r for r in request_ids if r)

    def pending(self, step: int) -> Accumulated | None:
        """The gradients for update `step`, frozen for averaging or still open."""
        frozen = self.frozen
        return frozen if frozen is not None and frozen.step == step else self._open.get(step)

    def samples_for(self, step: int) -> int:
        acc = self.pending(step)
        return 0 if acc is None else acc.samples

    def get(self, step: int) -> Accumulated | None:
        """The open accumulator of `step` (tests and the look-ahead read it)."""
        return self._open.get(step)

    def freeze(self) -> Accumulated:
        """Freeze the accumulator of `accumulating_step`; new gradients go into the next update."""
        frozen = self._open.pop(self.accumulating_step, None) or Accumulated(None, 0, self.accumulating_step)
        if frozen.grads is None:
            frozen.grads = [torch.zeros_like(p) for p in self.params]
        self._recent_ids.append(frozen.request_ids)
        self.accumulating_step += 1
        self.frozen = frozen
        return frozen

    def carry(self, frozen: Accumulated, step: int) -> None:
        """Add a frozen gradient to the open accumulator of `step`."""
        acc = self._open.get(step)
        if acc is None:
            acc = self._open[step] = Accumulated(None, 0, step)
        if acc.grads is None:
            acc.grads = [g.clone() for g in frozen.grads]
        else:
            for buf, g in zip(acc.grads, frozen.grads, strict=True):
                buf.add_(g)
        acc.samples += frozen.samples
        acc.request_ids |= frozen.request_ids
        if self.frozen is frozen:
            self.frozen = None

    def on_step_changed(self, step: int, drop_stale: bool) -> None:
        """The parameters are now at `step` (an update was applied, or a state loaded): gradients go
        into `step` or later; a frozen gradient of an earlier update is done with. `drop_stale`
        (a loaded state): open accumulators of updates the state already holds are dropped too."""
        self.accumulating_step = max(self.accumulating_step, step) if not drop_stale else step
        if self.frozen is not None and self.frozen.step < step:
            self.frozen = None
        if drop_stale:
            self._open = {s: a for s, a in self._open.items() if s >= step}
