"""The peer's rebalancing loop: every `rebalance_period` seconds (with jitter) it computes, from the
stage records on the DHT, the one move that would raise the swarm's throughput the most
(swarm.rebalance.plan_move), and carries it out if this peer is the one to move.

Every peer computes the same plan from (nearly) the same records, so one peer moves per round. A
peer that decided to move waits a random moment and checks the plan again on fresh records before
it drains, so two peers acting on stale views do not both move. Moving peers count at their new
stage (their record there says "joining"); a peer that joined or moved recently does not move.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import TYPE_CHECKING

from swarm.training.models import stage_costs
from swarm.policy.rebalance import Move, PeerInfo, plan_move

if TYPE_CHECKING:
    from swarm.peer.daemon import Peer

logger = logging.getLogger(__name__)

# a stage-mate counts as present for a move only if it answered Info this recently (mates are
# polled every 0.1 s; a killed one fails its next poll at once, a frozen one stops answering)
MATE_ANSWER_S = 2.0


def assignment_from_records(records: dict, num_stages: int) -> list[PeerInfo]:
    """The swarm's current assignment: online peers where they serve, joining peers where they go;
    draining and offline records are left out. A peer listed twice (mid-move) counts once, at its
    destination."""
    seen: dict[str, PeerInfo] = {}
    for stage in range(num_stages):
        for entry in records.get(stage, []):
            rec = entry.record
            if rec.state == "joining" or (rec.state == "online" and rec.peer_id not in seen):
                seen[rec.peer_id] = PeerInfo(rec.peer_id, stage, max(rec.throughput, 1e-3))
    return list(seen.values())


class PlacementLoop:
    def __init__(self, peer: Peer, rng: random.Random | None = None) -> None:
        self.peer = peer
        self.rng = rng or random.Random()

    async def plan(self) -> Move | None:
        peer = self.peer
        loop = asyncio.get_running_loop()
        records = await loop.run_in_executor(None, peer.dht.get_all_stages, peer.run.num_stages)
        assignment = assignment_from_records(records, peer.run.num_stages)
        if not any(p.peer_id == peer.dht.peer_id for p in assignment):
            return None  # this peer's own record is not visible yet
        if any(e.record.state == "draining" for entries in records.values() for e in entries):
            return None  # a move (or a departure) is under way: let the records settle first
        costs = stage_costs(peer.run.model, peer.run.num_stages)
        return plan_move(assignment, peer.run.num_stages, peer.cfg.rebalance_threshold, stage_costs=costs)

    def _mates_caught_up(self) -> bool:
        """Leave a stage only to mates that answer now and hold its current state: a mate still
        joining (or one whose step is unknown) could otherwise be left alone with an old state, and
        a mate that just died still counts as live for a few seconds (its DHT record, `dead_after`):
        leaving then would empty the stage. A mate counts only if its latest poll succeeded, recently."""
        peer = self.peer
        now = time.monotonic()
        mates = [m for m in peer.live_mates() if m.record_state == "online"]
        step = peer.executor.step
        ok = bool(mates) and all(
            m.last_info_ok and m.info_failures == 0 and now - m.last_info_ok < MATE_ANSWER_S and m.step >= step - 1
            for m in mates
        )
        if not ok:
            logger.info("not moving yet: the stage-mates have not caught up with step %d", step)
        return ok

    async def run(self) -> None:
        peer, cfg = self.peer, self.peer.cfg
        while not peer.stop_event.is_set():
            await asyncio.sleep(cfg.rebalance_period * self.rng.uniform(0.7, 1.3))
            if peer.serving.state != "online" or time.monotonic() - peer.last_placement < cfg.move_cooldown:
                continue
            try:
                move = await self.plan()
                if move is None or move.peer_id != peer.dht.peer_id:
                    continue
                if not self._mates_caught_up():
                    continue
                await asyncio.sleep(self.rng.uniform(0.0, 1.0))
                confirmed = await self.plan()  # fresh records: still this peer, still this move?
                if confirmed is None or confirmed.peer_id != peer.dht.peer_id or confirmed.dst != move.dst:
                    continue
                if not self._mates_caught_up():  # a mate may have died during the pause
                    continue
                await peer.move_to(move.dst, move.reason, move.before, move.after)
            except Exception:  # noqa: BLE001 - a failed round must not stop rebalancing or the peer
                logger.exception("rebalancing round failed")
