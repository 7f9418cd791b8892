"""When and how the peers of a stage apply an update together.

Trainers tag every microbatch with the step it is meant for and send exactly the global batch per
step. When the stage-mates together hold the global batch for the next update, each peer freezes its
accumulator and the stage agrees on what the update holds (swarm.peer.agreement): every contribution
of the step exactly once. Then the stage averages the accumulators (swarm.peer.direct; hivemind's
all-reduce in large stages), every peer applies the same mean gradient with the same learning rate
and clipping, and records the update in its ledger. If the agreement finds the stage not ready (a
contribution held twice, a mate missing, not yet frozen), the peers unfreeze and wait: nothing is
ever applied with fewer or more samples than the step's.

Other reasons to act:
- behind: a mate already applied this update without this peer (it missed the round, was paused,
  or was accused of lying: its mates leave it out of every update, and it does not try to average
  with them): download that mate's state; the gradients this peer held for it are in the downloaded
  update, else dropped and replayed by the trainers (swarm.peer.executor.compute.load_state_dict);
- diverged: same step, different parameters than the stage's reference peer: download its state.
A stage whose count stays below the global batch waits (a dead trainer's restart completes its
microbatches); it says so in its log and events, it never steps with what it has.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from swarm.cluster.accusations import AccusationReads
from swarm.cluster.view import PeerStatus
from swarm.core.log import set_context
from swarm.core.states import PeerState, UpdateReason
from swarm.peer.agreement import Agreement, agree, fetch_contributions
from swarm.peer.direct import average_direct
from swarm.peer.executor import Accumulated, StageExecutor
from swarm.peer.timeline import UpdateTimeline
from swarm.training.averaging import AveragingFailed, StageAverager
from swarm.wire.pool import ClientPool

logger = logging.getLogger(__name__)

FINGERPRINT_TOLERANCE = 1e-9  # relative; rounding noise is orders of magnitude smaller, divergence larger
AGREE_WAIT_S = 3.0  # how long a frozen peer waits for its mates to freeze the same update
AGREE_POLL_S = 0.02
CONTRIBUTIONS_TIMEOUT_S = 5.0
# a peer behind its stage that could download no mate's state tries again after this (the mates
# refuse a host's state request within 1 s of its last, Limits.state_call_interval_s)
BEHIND_RETRY_S = 1.0
STALL_READ_S = 1.0  # a stage short of its batch this long asks its view for a DHT read (a new mate?)


def fingerprints_agree(a: tuple[float, float], b: tuple[float, float], tol: float = FINGERPRINT_TOLERANCE) -> bool:
    """Compare (sum, sum of |p|) parameter fingerprints of two peers at the same step."""
    scale = max(abs(a[1]), abs(b[1]), 1e-30)
    return abs(a[0] - b[0]) <= tol * scale and abs(a[1] - b[1]) <= tol * scale


class StageMates(Protocol):
    """What the step coordinator needs of the peer's membership (swarm.peer.membership)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def stage(self) -> int: ...

    def live_mates(self) -> list[PeerStatus]: ...

    async def sync_from_mates(self, preferred: PeerStatus | None = None) -> bool: ...

    async def refresh_view(self) -> None: ...

    async def refresh_accusations(self) -> None: ...

    def want_view_read(self) -> None: ...

    def is_accused(self) -> bool: ...

    def event(self, kind: str, **fields: object) -> None: ...

    def start_averager(self) -> StageAverager | None: ...


class StepCoordinator:
    def __init__(
        self,
        executor: StageExecutor,
        averager: StageAverager | None,
        mates: StageMates,
        clients: ClientPool,
        run_id: str,
        global_batch: int,
        after_update: Callable[[int], None] | None = None,
        stall_report_s: float = 30.0,
        direct_max: int = 0,
        direct_timeout_s: float = 30.0,
        shard_min_bytes: int = 0,
    ) -> None:
        self.executor, self.averager, self.mates, self.clients = executor, averager, mates, clients
        self.run_id, self.global_batch, self.after_update = run_id, global_batch, after_update
        self.stall_report_s = stall_report_s  # a stage short of its global batch this long says so
        self.direct_max, self.direct_timeout_s, self.shard_min_bytes = direct_max, direct_timeout_s, shard_min_bytes
        self.peer_id = mates.peer_id
        self.resyncs = 0
        # read when a poller says a member is accused, not before every update (swarm.cluster.accusations)
        self.accusations = AccusationReads(mates.refresh_accusations, self._unaccused_members)
        self.last_averaging_s = 0.0
        self.failed_rounds = 0
        self.timeline = UpdateTimeline()
        self._agree_waited = 0.0  # of the last agreement: before the round that found every mate frozen
        self._straggler_s = 0.0  # of the last averaging: a mate not averaging the update yet
        self._last_total: tuple[int, int] = (-1, -1)
        self._last_change = time.monotonic()
        self._stall_reported = False
        self._stall_read = False  # this stall asked its view for a DHT read
        self._behind_retry_at = 0.0  # after a failed state download: not before this (monotonic)

    # ---- deciding ----

    def diverged_from(self) -> PeerStatus | None:
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
        step = ex.step  # the next update to apply; mates report their samples for theirs
        total = ex.samples_accumulated + sum(m.samples_accumulated for m in mates if m.step == step)
        if any(m.step > step for m in mates):
            return UpdateReason.BEHIND if time.monotonic() >= self._behind_retry_at else None
        if self.mates.is_accused():
            return None  # its mates leave it out of their updates: it follows them (behind, above)
        if self.diverged_from() is not None:
            return UpdateReason.DIVERGED
        if total >= self.global_batch:
            return UpdateReason.FULL
        self._watch_stall(step, total)
        return None

    def _watch_stall(self, step: int, total: int) -> None:
        now = time.monotonic()
        if (step, total) != self._last_total:
            self._last_total, self._last_change, self._stall_reported = (step, total), now, False
            self._stall_read = False
            return
        if total > 0 and now - self._last_change > STALL_READ_S and not self._stall_read:
            self._stall_read = True  # once per stall: the periodic reads go on after it
            self.mates.want_view_read()  # a mate that joined may hold the rest: its record is news
        if total > 0 and now - self._last_change > self.stall_report_s and not self._stall_reported:
            self._stall_reported = True
            logger.warning(
                "stage holds %d of %d samples for step %d and none came for %.0f s: waiting for the rest "
                "(a dead trainer's restart completes its microbatches)",
                total, self.global_batch, step, self.stall_report_s,
            )  # fmt: skip
            self.mates.event("stalled", step=step, samples=total, of=self.global_batch)

    # ---- acting ----

    async def run_update(self, reason: UpdateReason) -> None:
        ex = self.executor
        if reason == UpdateReason.BEHIND:
            if not await self.mates.sync_from_mates():
                self._behind_retry_at = time.monotonic() + BEHIND_RETRY_S
                logger.warning("behind the stage at step %d, and no mate's state could be downloaded yet", ex.step)
            set_context(step=ex.step)
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
        # a peer accused a moment ago takes no part (a read its hint started is awaited while this one freezes)
        start = time.monotonic()
        frozen, _ = await asyncio.gather(asyncio.wrap_future(ex.call(ex.take_accumulated)), self.accusations.wait())
        if self.mates.is_accused():  # this peer itself: its mates will not average with it
            await asyncio.wrap_future(ex.call(ex.unfreeze))
            return
        t_frozen = time.monotonic()
        agreement = await self._agree(frozen)
        if agreement is None or not await self._settle(agreement):
            self.timeline.failed_round_s += time.monotonic() - start
            return
        t_agreed = time.monotonic()
        self._straggler_s = 0.0
        averaged = await self._average(frozen, agreement)
        if averaged is None:
            await asyncio.wrap_future(ex.call(ex.unfreeze))
            self.timeline.failed_round_s += time.monotonic() - start
            return
        t_averaged = time.monotonic()
        members = agreement.members
        try:
            norm = await asyncio.wrap_future(
                ex.call(lambda: ex.apply_mean_gradient(averaged, frozen.step, members, agreement.union))
            )
        finally:
            ex.averaging_step = None
        self.timeline.record(
            start, t_frozen, t_agreed, t_averaged, time.monotonic(), self._agree_waited, self._straggler_s
        )
        set_context(step=ex.step)
        logger.info(
            "applied update %d: %d samples here, %d in all, averaged over %d peer(s) in %.2f s (grad norm %.3f)",
            frozen.step, frozen.samples, agreement.samples, len(members),
            self.last_averaging_s if len(members) > 1 else 0.0, norm,
        )  # fmt: skip
        if self.after_update is not None:
            self.after_update(ex.step)

    def _unaccused_members(self) -> set[str]:
        """The live members of the stage not known accused, this peer included."""
        own = set() if self.mates.is_accused() else {self.peer_id}
        return own | {m.peer_id for m in self.mates.live_mates()}

    async def _agree(self, frozen: Accumulated) -> Agreement | None:
        """The frozen lists of this peer and its live mates for the frozen update (waiting briefly
        for mates that have not frozen it yet); None when a mate already applied it."""
        ex = self.executor
        began = time.monotonic()
        deadline = began + AGREE_WAIT_S
        while True:
            self._agree_waited = time.monotonic() - began  # before this round: waiting for mates to freeze
            own = ex.contributions(frozen.step)  # a snapshot under its lock: no wait for the compute thread
            lists = {self.peer_id: own}
            for mate, snap in zip(*await self._mates_lists(frozen.step), strict=True):
                if snap is not None:
                    if snap.applied_step > frozen.step:
                        await asyncio.wrap_future(ex.call(ex.unfreeze))
                        return None  # the mates applied it without this peer: "behind" next time
                    lists[mate.peer_id] = snap
            agreement = agree(frozen.step, lists)
            if not agreement.not_frozen or time.monotonic() > deadline or self._short(agreement):
                return agreement
            await asyncio.sleep(AGREE_POLL_S)

    def _short(self, agreement: Agreement) -> bool:
        """Whether the stage, frozen or not, holds less than the step's batch: waiting for the mates
        to freeze cannot make this round ready (a mate dropped what it held and the trainers replay
        it; this peer's view still counted it). The round fails now instead of after AGREE_WAIT_S,
        which was 3 s lost at every such drop. Outliers excepted: those are judged on frozen lists."""
        return not agreement.outliers and agreement.samples < self.global_batch

    async def _mates_lists(self, step: int):
        mates = [m for m in self.mates.live_mates() if m.record_state.serving]

        async def one(m: PeerStatus):
            client = self.clients.get(m.load.address)
            try:
                return await fetch_contributions(client, self.run_id, self.mates.stage, step, CONTRIBUTIONS_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - an unreachable mate takes no part in this round
                logger.info("mate %s did not say what it holds for update %d: %s", m.peer_id[-6:], step, e)
                return None

        return mates, await asyncio.gather(*(one(m) for m in mates))

    async def _settle(self, agreement: Agreement) -> bool:
        """True if the update can be averaged now; else unfreeze (and drop, if this peer lost a
        duplicate) so that the trainers' requests and replays come in again."""
        ex = self.executor
        if agreement.ready(self.global_batch):
            return True
        if agreement.outliers:
            await self._left_out(agreement)
            return False
        elsewhere = agreement.must_drop(self.peer_id)
        if elsewhere is not None:
            dropped = await asyncio.wrap_future(ex.call(lambda: ex.drop_unapplied(elsewhere)))
            logger.warning(
                "update %d: %d contribution(s) held by a mate too; dropped this peer's %d unapplied samples "
                "for the trainers to replay (the mates keep the duplicates)",
                agreement.step, len(elsewhere), dropped,
            )  # fmt: skip
            self.mates.event("duplicate_dropped", step=agreement.step, duplicates=len(elsewhere), samples=dropped)
            return False
        await asyncio.wrap_future(ex.call(ex.unfreeze))
        if agreement.duplicates or agreement.samples > self.global_batch:
            logger.info("update %d: a mate holds a duplicate and drops it; waiting for the replays", agreement.step)
        else:  # a failed round, counted in the timeline's failed_round_s: say why
            logger.info(
                "update %d not agreed: %d of %d samples among %d member(s)%s; unfrozen, the stage tries again",
                agreement.step, agreement.samples, self.global_batch, len(agreement.members),
                f", not frozen: {', '.join(p[-6:] for p in agreement.not_frozen)}" if agreement.not_frozen else "",
            )  # fmt: skip
        return False

    async def _left_out(self, agreement: Agreement) -> None:
        """Outliers by the norm rule: the outlier drops what it holds (the trainers replay it on its
        mates); every member says so, counted, and waits for the replays."""
        ex = self.executor
        ratio = agreement.outliers.get(self.peer_id)
        if ratio is not None:
            dropped = await asyncio.wrap_future(ex.call(lambda: ex.drop_unapplied(outlier_step=agreement.step)))
            logger.warning(
                "update %d: this peer's gradient norm is %.1fx its mates' median: left out of the update, its %d "
                "unapplied samples dropped for the trainers to replay on its mates",
                agreement.step, ratio, dropped,
            )  # fmt: skip
        else:
            await asyncio.wrap_future(ex.call(ex.unfreeze))
            logger.warning(
                "update %d: left out %s (gradient norm %s x the others' median); waiting for the replays",
                agreement.step, ", ".join(p[-6:] for p in agreement.outliers),
                ", ".join(f"{r:.1f}" for r in agreement.outliers.values()),
            )  # fmt: skip
        self.mates.event("outlier_excluded", step=agreement.step, peers=[p[-12:] for p in agreement.outliers])

    async def _average(self, frozen: Accumulated, agreement: Agreement) -> list | None:
        """The mean gradient over the agreed members, or None if the all-reduce failed (the caller
        unfreezes and the stage tries again: never applied with a part of the stage's gradients)."""
        members = [p for p, _ in agreement.members]
        if len(members) == 1:
            return [g / max(1, agreement.samples) for g in frozen.grads]
        mates = [p for p in members if p != self.peer_id]
        try:
            if len(members) <= self.direct_max:
                addresses = {m.peer_id: m.load.address for m in self.mates.live_mates()}
                # its mates may fetch its frozen sum now, and until it is applied (run_update resets this after
                # the apply, which keeps the sum as `recent_frozen`: reset before it, a mate's fetch in between
                # found neither and failed the mate's round); its reduced shard (3+ members) stays until the next
                self.executor.averaging_step = frozen.step
                try:
                    avg = await average_direct(
                        frozen, self.peer_id, agreement, addresses, agreement.samples_by_member, self.clients,
                        self.run_id, self.mates.stage, self.executor.params, self.direct_timeout_s,
                        publish=self.executor.keep_reduced, shard_min_bytes=self.shard_min_bytes,
                    )  # fmt: skip
                    self.executor.counters.sharded_rounds += avg.sharded
                except BaseException:
                    self.executor.averaging_step = None
                    raise
            else:
                if self.averager is None:  # its first round of more than direct_max members
                    self.averager = self.mates.start_averager()
                if self.averager is None:
                    raise AveragingFailed(f"averaging for step {frozen.step}: this peer is leaving its stage")
                avg = await asyncio.get_running_loop().run_in_executor(
                    None, self.averager.average, frozen.grads, frozen.samples, frozen.step, mates
                )
        except AveragingFailed as e:
            self.failed_rounds += 1
            logger.warning("%s; the stage tries again", e)
            self.mates.event("averaging_failed", step=frozen.step, members=len(members))
            if self.averager is not None and not self.averager.alive:  # its process died: a new one
                try:
                    self.averager = self.mates.start_averager()
                except AveragingFailed as again:
                    logger.warning("%s; the next round tries again", again)
                    self.averager = None
            await self.mates.refresh_view()  # the members may have disagreed on who is in the stage
            return None
        self.executor.counters.averaging_rounds += 1
        self.last_averaging_s = avg.seconds
        self._straggler_s = avg.straggler_s
        return avg.mean
