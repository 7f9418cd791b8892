"""Holding and replaying gradients: a stage's Backward is held by the trainer until the stage's ledger
(GetLedger) shows the microbatch in an applied update. If the peer that holds its gradient dies,
moves, stops answering or drops its unapplied gradients (its accumulator epoch changes) first, the
record is replayed on a stage-mate with the same contribution id, so that each sample's gradient
enters each stage exactly once: never lost, never counted twice (a peer that already holds it says
so, and where)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from swarm.cluster.ledger import fetch_ledger
from swarm.cluster.view import SwarmView
from swarm.trainer.microbatch import HeldBackward, Microbatch
from swarm.trainer.report import Stats
from swarm.trainer.router import MicrobatchFailed, MicrobatchRejected, Router, StageUnavailable
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb

logger = logging.getLogger(__name__)

REPLAY_CHECK_S = 0.2
MIN_REPLAY_GAP_S = 1.0  # a record is not judged lost within this long of its holder's answer
UNKNOWN_HOLDER_GRACE_S = 5.0  # a holder this view has not discovered yet counts as lost after this long
LEDGER_CHECK_S = 0.5
LEDGER_TIMEOUT_S = 5.0
SETTLE_S = 30.0  # at the end of training, the longest stay for held records to be released


class Replayer:
    def __init__(
        self, view: SwarmView, router: Router, clients: ClientPool, run_id: str, stats: Stats, progress: asyncio.Event
    ) -> None:
        self.view, self.router, self.clients, self.run_id = view, router, clients, run_id
        self.stats, self.progress = stats, progress
        self.held: list[HeldBackward] = []

    def hold(self, mb: Microbatch, stage: int, response: pb.BackwardResponse, peer_id: str, request, tensors) -> None:
        """Keep a stage's Backward; its gradient is held by the peer that answered, or, for a
        duplicate, by the peer that answer names."""
        mb.held.add(stage)
        self.held.append(
            HeldBackward(mb, stage, *_holder(response, peer_id), int(response.accumulated_step), request, tensors)
        )

    def holds(self, cid: str, stage: int) -> bool:
        """Whether a record of contribution `cid` at `stage` is held (from an earlier run of it)."""
        return any(r.stage == stage and r.mb.cid == cid for r in self.held)

    def forget(self, mb: Microbatch) -> None:
        """Drop the records of a microbatch that did not finish (it runs again, or was given up)."""
        self.held = [r for r in self.held if r.mb is not mb]

    async def release_applied(self) -> None:
        """Drop the records that the stage's ledger shows in an update every live peer of the stage
        has applied. (Applied by one peer only, an update dies with it: that peer's all-reduce
        completed, its mate's failed, and it was killed before the mate caught up from it. Its
        gradients are still replayed then, and the mate applies the update with them.)"""
        stages = sorted({r.stage for r in self.held})
        applied: set[tuple[int, str]] = set()
        for stage in stages:
            from_step = min(r.accumulated_step for r in self.held if r.stage == stage)
            through = self._applied_by_all(stage)
            if through > from_step:
                ids = await self._applied_ids(stage, from_step, through)
                applied |= {(stage, cid) for cid in ids}
        keep = []
        for rec in self.held:
            if (rec.stage, rec.mb.cid) in applied:
                rec.mb.held.discard(rec.stage)
            else:
                keep.append(rec)
        if len(keep) != len(self.held):
            self.held = keep
            self.progress.set()

    def _applied_by_all(self, stage: int) -> int:
        """Updates 0 .. n-1 every live serving peer of the stage has applied (0 when it has none)."""
        steps = [p.step for p in self.view.stage_peers(stage) if p.last_info_ok and p.record_state.serving]
        return min(steps, default=0)

    async def _applied_ids(self, stage: int, from_step: int, through: int) -> set[str]:
        """Contribution ids in the stage's updates from_step .. through-1, from a live peer that
        has applied them (empty when none answers)."""
        peers = [p for p in self.view.stage_peers(stage) if p.last_info_ok and p.step > from_step]
        for peer in sorted(peers, key=lambda p: -p.step)[:2]:
            client = self.clients.get(peer.load.address)
            try:
                entries = await fetch_ledger(client, self.run_id, stage, from_step, LEDGER_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - try another peer, or the next round
                logger.debug("ledger of stage %d from %s: %s", stage, peer.peer_id[-6:], e)
                continue
            return {cid for e in entries if e.step < through for cid in e.contributions}
        return set()

    def lost(self, rec: HeldBackward) -> bool:
        """The gradient's holder is gone, unreachable, moved to another stage, dropped it, or was
        accused of lying (its mates leave it out of their updates). "Dropped it" needs an Info asked
        after the holder's answer: an older one may still show the epoch before a drop that came
        before the answer, and replaying on such a view put the same gradient on two peers."""
        if rec.holder in self.view.accused:
            return True
        since_answer = time.monotonic() - rec.answered
        if since_answer < MIN_REPLAY_GAP_S:
            return False  # just answered (or just replayed): nothing this view says can be newer yet
        status = self.view.peers.get(rec.holder)
        if status is None:
            # a holder that a duplicate answer named may not be in this view yet (a peer that just
            # joined): replaying at once looped, a replay every 0.2 s, each answered "already held"
            self.view.dht_reads.want()
            return since_answer > UNKNOWN_HOLDER_GRACE_S
        if status.stage != rec.stage or not self.view.is_live(status):
            return True
        return status.last_info_ok > 0 and status.info_asked > rec.answered and status.epoch != rec.epoch

    def _replay_exclude(self, rec: HeldBackward) -> set[str]:
        """Where a replay must not go: the holder, unless it is live and the stage's only usable
        peer. A live holder that dropped the gradient may have been left out of the update by the
        stage's outlier rule (swarm.peer.agreement): replayed on it again, the same samples gave it
        the same outlying norm, and the stage looped (75 s in one run) until a replay chanced on a
        mate. (A dropped duplicate's other contributions may go anywhere: a mate that already holds
        one answers "duplicate".)"""
        status = self.view.peers.get(rec.holder)
        if status is None or not self.view.is_live(status) or rec.holder in self.view.accused:
            return {rec.holder}  # gone
        usable = (
            p for p in self.view.stage_peers(rec.stage) if self.view.is_live(p) and p.peer_id not in self.view.accused
        )
        return {rec.holder} if any(p.peer_id != rec.holder for p in usable) else set()

    async def replay(self, rec: HeldBackward) -> None:
        rec.replays += 1
        exclude = self._replay_exclude(rec)
        try:
            response, _, peer = await self.router.call(
                rec.stage, rec.request, rec.tensors, rec.mb.samples, "backward", exclude=exclude
            )
        except (StageUnavailable, MicrobatchFailed, MicrobatchRejected) as e:
            logger.warning("replay of %s on stage %d failed: %s", rec.mb.cid, rec.stage, e)
            rec.replays -= 1
            return
        rec.holder, rec.epoch = _holder(response, peer.peer_id)
        rec.accumulated_step, rec.answered = int(response.accumulated_step), time.monotonic()
        self.stats.replays += 1
        where = "already held by " if response.duplicate else "on "
        logger.info("replayed %s's gradient on stage %d: %s%s", rec.mb.cid, rec.stage, where, rec.holder[-6:])

    async def settle(self, wait_s: float, stop: asyncio.Event) -> None:
        """At the end of training: stay (replaying) until every record is released, at most `wait_s`.
        The global step counts a stage done when one of its peers applied the last update; if that
        peer died before its mates had its sum, they rebuild the update from these records' replays."""
        deadline = time.monotonic() + wait_s
        while self.held and time.monotonic() < deadline and not stop.is_set():
            self.progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(1.0, max(0.0, deadline - time.monotonic()))):
                    await self.progress.wait()
        if self.held:  # stopped early, the steps in flight are not applied: no surprise then
            stages = sorted({r.stage for r in self.held})
            logger.log(
                logging.INFO if stop.is_set() else logging.WARNING,
                "training ends with %d gradient record(s) of stages %s not yet shown applied by every live peer "
                "of their stage", len(self.held), stages,
            )  # fmt: skip

    async def run(self) -> None:
        replaying: set[int] = set()
        loop = asyncio.get_running_loop()
        last_ledger = 0.0
        while True:
            await asyncio.sleep(REPLAY_CHECK_S)
            if loop.time() - last_ledger >= LEDGER_CHECK_S:
                last_ledger = loop.time()
                await self.release_applied()
            for rec in list(self.held):
                if id(rec) in replaying or not self.lost(rec):
                    continue
                replaying.add(id(rec))
                task = asyncio.create_task(self.replay(rec))
                task.add_done_callback(lambda _t, key=id(rec): replaying.discard(key))


def _holder(response: pb.BackwardResponse, peer_id: str) -> tuple[str, int]:
    """(holder, its epoch) of a Backward's gradient: the answering peer's, or for a duplicate the
    peer the answer names."""
    if response.duplicate and response.holder:
        return response.holder, int(response.holder_epoch)
    return peer_id, int(response.epoch)
