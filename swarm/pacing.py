"""Which step a trainer's next microbatch is for, and whether the staleness bound lets it start.

Each trainer contributes exactly `share` samples to every step ("tag"), so a stage's count for a
step is exact. In async mode a trainer may start samples of steps after the global step (the step
the slowest stage is at) up to `staleness` x `share` of them: 1 lets it start all of step t+1 while
step t is pending, 0.5 half of it, 0 nothing (exact mode). Fractions trade throughput (the pipeline
stays fed while the stages average) against staleness (each early sample's gradient is computed at
parameters one update old, or at predicted ones: see swarm.optim.predicted_params).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class StepPacer:
    share: int  # samples per step from this trainer
    staleness: float  # steps' worth of samples that may start ahead of the global step
    next_tag: int = 0
    tag_left: int = 0

    def __post_init__(self) -> None:
        if self.share < 1 or self.staleness < 0:
            raise ValueError(f"bad pacing: share {self.share}, staleness {self.staleness}")
        self.tag_left = self.tag_left or self.share

    def restart(self, step: int) -> None:
        self.next_tag, self.tag_left = step, self.share

    def started_ahead(self, global_step: int) -> int:
        """Samples this trainer has started for steps after `global_step`."""
        return max(0, (self.next_tag - global_step) * self.share - self.tag_left)

    def take(self, global_step: int, microbatch: int, target: int) -> tuple[int, int] | None:
        """(step tag, samples) of the next microbatch, or None while the bound holds the trainer
        back or every step before `target` is fed."""
        g = global_step
        if self.next_tag < g or self.next_tag > g + math.ceil(self.staleness) + 1:
            # the swarm moved past steps this trainer did not feed, or a stage was restored from an
            # older checkpoint: feed the step the slowest stage is at
            self.restart(g)
        if self.next_tag >= target:
            return None
        n = min(microbatch, self.tag_left)
        if self.next_tag > g and self.started_ahead(g) + n > self.staleness * self.share + 1e-9:
            return None
        tag = self.next_tag
        self.tag_left -= n
        if self.tag_left == 0:
            self.next_tag, self.tag_left = self.next_tag + 1, self.share
        return tag, n
