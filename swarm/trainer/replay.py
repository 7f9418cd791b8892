"""Holding and replaying gradients: a stage's Backward is held by the trainer until the peer that
accumulated it has applied that update; if the peer dies, moves or stops answering first, the record
is replayed on a stage-mate, so that no sample's gradient is silently lost."""

from __future__ import annotations

import asyncio
import logging

from swarm.cluster.view import SwarmView
from swarm.trainer.microbatch import HeldBackward, Microbatch
from swarm.trainer.report import Stats
from swarm.trainer.router import MicrobatchFailed, MicrobatchRejected, Router, StageUnavailable
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor

logger = logging.getLogger(__name__)

REPLAY_CHECK_S = 0.2


class Replayer:
    def __init__(self, view: SwarmView, router: Router, stats: Stats, progress: asyncio.Event) -> None:
        self.view, self.router, self.stats, self.progress = view, router, stats, progress
        self.held: list[HeldBackward] = []

    def hold(
        self,
        mb: Microbatch,
        stage: int,
        peer_id: str,
        accumulated_step: int,
        request: pb.BackwardRequest,
        tensors: dict[str, WireTensor],
    ) -> None:
        mb.held.add(stage)
        self.held.append(HeldBackward(mb, stage, peer_id, accumulated_step, request, tensors))

    def forget(self, mb: Microbatch) -> None:
        """Drop the records of a microbatch that did not finish (it runs again, or was given up)."""
        self.held = [r for r in self.held if r.mb is not mb]

    def release_applied(self) -> None:
        """Drop the records whose peer has applied the update they went into."""
        keep = []
        for rec in self.held:
            status = self.view.peers.get(rec.peer_id)
            if status is not None and status.stage == rec.stage and status.step > rec.accumulated_step:
                rec.mb.held.discard(rec.stage)
            else:
                keep.append(rec)
        if len(keep) != len(self.held):
            self.held = keep
            self.progress.set()

    def lost(self, rec: HeldBackward) -> bool:
        """Gone, unreachable, or moved to another stage before applying this gradient."""
        status = self.view.peers.get(rec.peer_id)
        return status is None or status.stage != rec.stage or not self.view.is_live(status)

    async def replay(self, rec: HeldBackward) -> None:
        rec.replays += 1
        rec.request.request_id = f"{rec.request.request_id}:r{rec.replays}"
        try:
            response, _, peer = await self.router.call(
                rec.stage, rec.request, rec.tensors, rec.mb.samples, "backward", exclude={rec.peer_id}
            )
        except (StageUnavailable, MicrobatchFailed, MicrobatchRejected) as e:
            logger.warning("replay of microbatch %d on stage %d failed: %s", rec.mb.mb_id, rec.stage, e)
            rec.replays -= 1
            return
        rec.peer_id = peer.peer_id
        rec.accumulated_step = int(response.accumulated_step)
        self.stats.replays += 1
        logger.info("replayed microbatch %d's gradient on stage %d peer %s", rec.mb.mb_id, rec.stage, peer.peer_id[-6:])

    async def run(self) -> None:
        replaying: set[int] = set()
        while True:
            await asyncio.sleep(REPLAY_CHECK_S)
            self.release_applied()
            for rec in list(self.held):
                if id(rec) in replaying or not self.lost(rec):
                    continue
                replaying.add(id(rec))
                task = asyncio.create_task(self.replay(rec))
                task.add_done_callback(lambda _t, key=id(rec): replaying.discard(key))
