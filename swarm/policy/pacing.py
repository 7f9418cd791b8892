"""Which step a trainer's next microbatch is for, and whether the staleness bound lets it start.

Each trainer contributes exactly `share` samples to every step ("tag"), so a stage's count for a
step is exact. In async mode a trainer may start samples of steps after the global step (the step
the slowest stage is at) up to `staleness` x `share` of them: 1 lets it start all of step t+1 while
step t is pending, 0.5 half of it, 0 nothing (exact mode). Fractions trade throughput (the pipeline
stays fed while the stages average) against staleness (each early sample's gradient is computed at
parameters one update old, or at predicted ones: see swarm.optim.predicted_params).

`ahead_after` paces the run-ahead: a microbatch of a step after the global step starts only once
that share of the trainer's samples of the step before it are done (their backward went through
every stage). The prediction of a pending update is only as good as the share of its gradient the
peers already hold (scripts/staleness_effect.py: +5.9% of validation loss with a quarter known, none
with half), and the pipeline stays fed: the rest of the step is still in flight.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class StepPacer:
    share: int  # samples per step from this trainer
    staleness: float  # steps' worth of samples that may start ahead of the global step
    ahead_after: float = 0.0  # share of step t's samples done before samples of t+1 start early
    next_tag: int = 0
    tag_left: int = 0
    done_samples: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        if self.share < 1 or self.staleness < 0 or not 0 <= self.ahead_after <= 1:
            raise ValueError(f"bad pacing: share {self.share}, staleness {self.staleness}, {self.ahead_after}")
        self.tag_left = self.tag_left or self.share

    def restart(self, step: int) -> None:
        self.next_tag, self.tag_left = step, self.share

    def done(self, tag: int, samples: int) -> None:
        """Samples of step `tag` finished (or were given up): they count toward `ahead_after`."""
        self.done_samples[tag] += samples

    def started_ahead(self, global_step: int) -> int:
        """Samples this trainer has started for steps after `global_step`."""
        return max(0, (self.next_tag - global_step) * self.share - self.tag_left)

    def take(self, global_step: int, microbatch: int, target: int) -> tuple[int, int, int] | None:
        """(step tag, offset in this trainer's share of that step, samples) of the next microbatch,
        or None while the bound holds the trainer back or every step before `target` is fed."""
        g = global_step
        if self.next_tag < g or self.next_tag > g + math.ceil(self.staleness) + 1:
            # the swarm moved past steps this trainer did not feed, or a stage was restored from an
            # older checkpoint: feed the step the slowest stage is at
            self.restart(g)
        if self.next_tag >= target:
            return None
        n = min(microbatch, self.tag_left)
        if self.next_tag > g:
            if self.started_ahead(g) + n > self.staleness * self.share + 1e-9:
                return None
            if self.done_samples[self.next_tag - 1] < self.ahead_after * self.share - 1e-9:
                return None
        for old in [t for t in self.done_samples if t < g - 1]:
            del self.done_samples[old]
        tag, offset = self.next_tag, self.share - self.tag_left
        self.tag_left -= n
        if self.tag_left == 0:
            self.next_tag, self.tag_left = self.next_tag + 1, self.share
        return tag, offset, n
