"""Which microbatch a trainer starts next: one queued to run again first, else the pacer's next
(step, offset) (swarm.policy.pacing), whose samples follow from that place in the trainer's stream.

The feed also knows which contributions are running (started, not finished or given up: a queued
retry counts). When the swarm's step goes back (the only peer of a stage that had applied an update
died before its mates had its sum), the pacer feeds that step again; a contribution of it that is
still running is skipped, and one whose Backward record the trainer still holds is replayed where it
was lost (the trainer's run of it gives the input gradient only: swarm.trainer.loop). Feeding it
again in full put a gradient computed at the later parameters into the rebuilt update, under the
original's contribution id, ahead of the replay of the right one."""

from __future__ import annotations

import collections
import json
import logging
from typing import IO

from swarm.policy.ledger import contribution_id, samples_digest
from swarm.policy.pacing import StepPacer
from swarm.trainer.microbatch import Microbatch
from swarm.training.data import ShardSampler

# steps whose completed contributions the feed remembers (a step fed again is at most a step or two
# behind the newest; the bound keeps the memory flat over a long run)
COMPLETED_STEPS_KEPT = 16

logger = logging.getLogger(__name__)


class MicrobatchFeed:
    def __init__(
        self, trainer_id: str, pacer: StepPacer, sampler: ShardSampler, dataset, microbatch: int, steps: int,
        sample_log: IO[str] | None = None,
    ) -> None:  # fmt: skip
        self.trainer_id, self.pacer, self.sampler, self.dataset = trainer_id, pacer, sampler, dataset
        self.microbatch, self.steps, self.sample_log = microbatch, steps, sample_log
        self.retry: collections.deque[Microbatch] = collections.deque()
        self.running: set[str] = set()
        self.completed: dict[int, set[str]] = {}  # step -> its contributions that completed here

    def next(self, global_step: int | None) -> Microbatch | None:
        """The next microbatch to start, or None while the staleness bound holds the trainer back."""
        if self.retry:
            return self.retry.popleft()
        while (taken := self.pacer.take(global_step or 0, self.microbatch, self.steps)) is not None:
            tag, offset, n = taken
            cid = contribution_id(self.trainer_id, tag, offset)
            if cid not in self.running:
                break
        else:
            return None
        if offset == 0 and cid in self.completed.get(tag, ()):
            logger.info("the swarm's step went back to %d: feeding it again (what completed repeats as checks)", tag)
        # the samples follow from the microbatch's place in this trainer's stream: the same after a
        # restart, so that a restarted trainer completes exactly what it had started
        indices = self.sampler.take(tag * self.pacer.share + offset, n)
        x, y = self.dataset.train(indices)
        mb = Microbatch(cid, indices, x, y, tag, samples_digest(indices))
        self.running.add(mb.cid)
        if self.sample_log is not None:
            self.sample_log.write(json.dumps({"cid": mb.cid, "step": tag, "indices": indices}) + "\n")
            self.sample_log.flush()
        return mb

    def again(self, mb: Microbatch, rejected: bool = False) -> None:
        """Queue the same samples for the same step to run again (it stays running)."""
        self.retry.append(mb.again(rejected=rejected))

    def finished(self, mb: Microbatch) -> None:
        """Done, or given up."""
        self.running.discard(mb.cid)

    def first_completion(self, mb: Microbatch) -> bool:
        """Record that `mb` completed; False if its contribution had completed before (its step was
        fed again): its samples were counted then, and a repeat must not count them twice."""
        done = self.completed.setdefault(mb.step_tag, set())
        first = mb.cid not in done
        done.add(mb.cid)
        if len(self.completed) > COMPLETED_STEPS_KEPT:
            del self.completed[min(self.completed)]
        return first
