"""When and how the peers of a stage apply an update together.

Trainers tag every microbatch with the step it is meant for and send exactly the global batch per
step, so a stage's count for a step is exact: the update is applied when the stage-mates together
hold the global batch ("full"). Then each peer freezes its accumulator, the stage averages the
accumulators (hivemind all-reduce, weighted by samples), and every peer applies the same mean
gradient with the same learning rate and clipping: the peers of a stage stay identical.

Fallbacks keep the run going:
- "behind": a mate already applied this update without this peer (it missed the averaging group,
  or was paused): download the state from that mate, carry this peer's own gradient into the next
  update (or drop it if it is more than one step stale), and go on;
- "partial": the stage total is stuck below the global batch for `partial_step_timeout_s` seconds
  (a trainer died mid-step): apply what the stage has;
- alone in its stage, a peer applies its own mean gradient.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from swarm.cluster.view import PeerStatus
from swarm.core.log import set_context
from swarm.core.states import CarryOutcome, PeerState, UpdateReason
from swarm.peer.executor import Accumulated, StageExecutor
from swarm.training.averaging import AveragingFailed, StageAverager, local_mean

logger = logging.getLogger(__name__)

MAX_AVERAGING_ATTEMPTS = 5
FINGERPRINT_TOLERANCE = 1e-9  # relative; rounding noise is orders of magnitude smaller, divergence larger


def fingerprints_agree(a: tuple[float, float], b: tuple[float, float], tol: float = FINGERPRINT_TOLERANCE) -> bool:
    """Compare (sum, sum of |p|) parameter fingerprints of two peers at the same step."""
    scale = max(abs(a[1]), abs(b[1]), 1e-30)
    return abs(a[0] - b[0]) <= tol * scale and abs(a[1] - b[1]) <= tol * scale


class StageMates(Protocol):
    """What the step coordinator needs of the peer's membership (swarm.peer.membership)."""

    @property
    def peer_id(self) -> str: ...

    def live_mates(self) -> list[PeerStatus]: ...

    async def sync_from_mates(self, preferred: PeerStatus | None = None) -> bool: ...

    async def refresh_view(self) -> None: ...


class StepCoordinator:
    def __init__(
        self,
        executor: StageExecutor,
        averager: StageAverager | None,
        mates: StageMates,
        global_batch: int,
        partial_step_timeout_s: float,
        after_update: Callable[[int], None] | None = None,
    ) -> None:
        self.executor = executor
        self.averager = averager
        self.mates = mates
        self.peer_id = mates.peer_id
        self.resyncs = 0
        self.last_averaging_s = 0.0
        self.global_batch = global_batch
        self.partial_step_timeout_s = partial_step_timeout_s
        self.after_update = after_update
        self._last_total: tuple[int, int] = (-1, -1)
        self._last_change = time.monotonic()

    def diverged_from(self):
        """The stage's reference peer (smallest id at this step) if this peer's parameters differ."""
        step, total, absolute = self.executor.fingerprint
        same = [
            m
            for m in self.mates.live_mates()
            if m.record_state == PeerState.ONLINE and m.step == step and m.last_info_ok
        ]
        if not same:
            return None
        reference = min(same, key=lambda m: m.peer_id)
        if reference.peer_id > self.peer_id or fingerprints_agree((total, absolute), reference.fingerprint):
            return None
        return reference

    def decide(self) -> UpdateReason | None:
        """Why to act now, or None to keep accumulating."""
        ex = self.executor
        mates = self.mates.live_mates()
        acc_step = ex.step  # the next update to apply; mates report their samples for theirs
        total = ex.samples_accumulated + sum(m.samples_accumulated for m in mates if m.step == acc_step)
        if any(m.step > ex.step for m in mates):
            return UpdateReason.BEHIND
        if self.diverged_from() is not None:
            return UpdateReason.DIVERGED
        if total >= self.global_batch:
            return UpdateReason.FULL
        now = time.monotonic()
        if (acc_step, total) != self._last_total:
            self._last_total, self._last_change = (acc_step, total), now
        elif total > 0 and now - self._last_change > self.partial_step_timeout_s:
            logger.warning(
                "stage holds %d of %d samples for step %d and none came for %.0f s: stepping with what it has",
                total,
                self.global_batch,
                acc_step,
                self.partial_step_timeout_s,
            )
            return UpdateReason.PARTIAL
        return None

    async def run_update(self, reason: UpdateReason) -> None:
        ex = self.executor
        if reason == UpdateReason.BEHIND:
            await self._catch_up(None)
            return
        if reason == UpdateReason.DIVERGED:
            reference = self.diverged_from()
            if reference is not None:
                logger.warning(
                    "parameters at step %d differ from %s's: downloading its state", ex.step, reference.peer_id[-6:]
                )
                if await self.mates.sync_from_mates(reference):
                    self.resyncs += 1
            return
        frozen: Accumulated = await asyncio.wrap_future(ex.call(ex.take_accumulated))
        averaged = await self._average(frozen)
        if averaged is None:
            await self._catch_up(frozen)  # the mates averaged without this peer
            return
        mean, members = averaged
        norm = await asyncio.wrap_future(ex.call(lambda: ex.apply_mean_gradient(mean, frozen.step, members)))
        set_context(step=ex.step)
        logger.info(
            "applied update %d: %d samples here, averaged over %d peer(s) in %.2f s (%s; grad norm %.3f)",
            frozen.step, frozen.samples, len(members), self.last_averaging_s if len(members) > 1 else 0.0, reason, norm,
        )  # fmt: skip
        if self.after_update is not None:
            self.after_update(ex.step)

    async def _average(self, frozen: Accumulated) -> tuple[list, tuple[str, ...]] | None:
        """(mean gradient, the peers whose gradients it holds) for the frozen update, from an
        all-reduce with the live mates (this peer's own when alone); None when the mates already
        applied it without this peer."""
        loop = asyncio.get_running_loop()
        for attempt in range(1, MAX_AVERAGING_ATTEMPTS + 1):
            mates = [m for m in self.mates.live_mates() if m.record_state.serving]
            if any(m.step > frozen.step for m in mates):
                return None
            if not mates or self.averager is None:
                break
            try:
                avg = await loop.run_in_executor(
                    None, self.averager.average, frozen.grads, frozen.samples, frozen.step, [m.peer_id for m in mates]
                )
            except AveragingFailed as e:
                if attempt == MAX_AVERAGING_ATTEMPTS:
                    logger.error("%s; %d attempts failed, applying this peer's own gradient", e, attempt)
                    break
                logger.warning("%s; retrying", e)
                await self.mates.refresh_view()  # the members may have disagreed on who is in the stage
                continue
            self.executor.counters.averaging_rounds += 1
            self.last_averaging_s = avg.seconds
            return avg.mean, avg.members
        return local_mean(frozen.grads, frozen.samples), (self.peer_id,)

    async def _catch_up(self, frozen: Accumulated | None) -> None:
        """Load the state of an up-to-date mate; keep this peer's gradient if it is one step stale."""
        ex = self.executor
        if frozen is None:
            frozen = await asyncio.wrap_future(ex.call(ex.take_accumulated))
        if not await self.mates.sync_from_mates():
            # nobody to copy from after all: apply what this peer has and go on
            own = local_mean(frozen.grads, frozen.samples)
            norm = await asyncio.wrap_future(ex.call(lambda: ex.apply_mean_gradient(own, frozen.step, (self.peer_id,))))
            logger.warning("could not reach an up-to-date mate; applied own update %d (norm %.3f)", frozen.step, norm)
            return

        def carry_over() -> CarryOutcome:
            if ex.last_update[0] == frozen.step and self.peer_id in ex.last_update[1]:
                # the mate's round completed with this peer's gradient although this peer's did not
                # (hivemind: one side received every part, the other not): it is in the update already
                return CarryOutcome.INCLUDED
            if frozen.samples and ex.step - frozen.step <= 1:
                ex.add_to_accumulator(frozen, ex.step)
                return CarryOutcome.CARRIED
            ex.counters.samples_discarded += frozen.samples
            return CarryOutcome.DROPPED

        outcome = await asyncio.wrap_future(ex.call(carry_over))
        set_context(step=ex.step)
        if outcome == CarryOutcome.INCLUDED:
            logger.info("the downloaded update %d already holds this peer's %d samples", frozen.step, frozen.samples)
        elif outcome == CarryOutcome.DROPPED and frozen.samples:
            logger.warning(
                "dropped %d samples of step %d: the stage is %d steps ahead",
                frozen.samples,
                frozen.step,
                ex.step - frozen.step,
            )
        elif outcome == CarryOutcome.CARRIED:
            logger.info("carried %d samples of step %d into step %d", frozen.samples, frozen.step, ex.step)
