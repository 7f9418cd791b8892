"""The peer's rebalancing loop: every `rebalance_period` seconds (with jitter) it computes, from the
stage records on the DHT, the one move that would raise the swarm's throughput the most
(swarm.rebalance.plan_move), and carries it out if this peer is the one to move.

Every peer computes the same plan from (nearly) the same records, so one peer moves per round. A
peer that decided to move waits a random moment and checks the plan again on fresh records before
it drains, so two peers acting on stale views do not both move. Moving peers count at their new
stage (their record there says "joining"); a peer that joined or moved recently does not move.

Except where a stage has no peer at all: the whole swarm is stalled then, so a round runs at once
(checked every EMPTY_STAGE_CHECK_S from the view's records, no extra DHT read) and the cooldown does
not hold the peer back. Peers started together (`--stage auto`, docker compose's replicas) cannot
see each other's choice yet and leave a stage empty about one time in four with 6 peers and 3 stages;
before this, the swarm then waited the 60 s cooldown plus a period.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Protocol

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.core.settings import LIVENESS_WINDOW_S
from swarm.core.states import PeerState
from swarm.dht.records import PeerEntry
from swarm.policy.rebalance import Move, PeerInfo, plan_move

logger = logging.getLogger(__name__)

# how often a peer looks for a stage that no record serves (then it plans a move at once)
EMPTY_STAGE_CHECK_S = 2.0

# a stage-mate counts as present for a move only if it answered Info this recently (mates are
# polled every 0.1 s; a killed one fails its next poll at once, a frozen one stops answering)
MATE_ANSWERED_WITHIN_S = LIVENESS_WINDOW_S / 2


class Movable(Protocol):
    """What the placement loop needs of the peer (its membership: swarm.peer.membership)."""

    @property
    def peer_id(self) -> str: ...

    @property
    def step(self) -> int: ...

    @property
    def stage(self) -> int: ...

    @property
    def view(self) -> SwarmView: ...

    def may_move(self, urgent: bool = False) -> bool: ...

    def read_records(self) -> dict[int, list[PeerEntry]]: ...

    def live_mates(self) -> list[PeerStatus]: ...

    async def move_to(self, dst: int, reason: str, before: float, after: float) -> None: ...


def assignment_from_records(records: dict, num_stages: int) -> list[PeerInfo]:
    """The swarm's current assignment: online peers where they serve, joining peers where they go;
    draining and offline records are left out. A peer listed twice (mid-move) counts once, at its
    destination."""
    seen: dict[str, PeerInfo] = {}
    for stage in range(num_stages):
        for entry in records.get(stage, []):
            rec = entry.record
            if rec.state == PeerState.JOINING or (rec.state == PeerState.ONLINE and rec.peer_id not in seen):
                seen[rec.peer_id] = PeerInfo(rec.peer_id, stage, max(rec.throughput, 1e-3))
    return list(seen.values())


def empty_stages(view: SwarmView, own_stage: int, num_stages: int) -> list[int]:
    """Stages that no DHT record serves (online or joining; the view leaves out this peer's own)."""
    serving = (PeerState.ONLINE, PeerState.JOINING)
    served = {s.stage for s in view.peers.values() if s.record_state in serving} | {own_stage}
    return [k for k in range(num_stages) if k not in served]


class PlacementLoop:
    def __init__(
        self,
        peer: Movable,
        num_stages: int,
        stage_costs: list[float] | None,
        period_s: float,
        threshold: float,
        rng: random.Random | None = None,
    ) -> None:
        self.peer, self.num_stages, self.stage_costs = peer, num_stages, stage_costs
        self.period_s, self.threshold = period_s, threshold
        self.rng = rng or random.Random()

    async def plan(self) -> Move | None:
        records = await asyncio.get_running_loop().run_in_executor(None, self.peer.read_records)
        assignment = assignment_from_records(records, self.num_stages)
        if not any(p.peer_id == self.peer.peer_id for p in assignment):
            return None  # this peer's own record is not visible yet
        if any(e.record.state == PeerState.DRAINING for entries in records.values() for e in entries):
            return None  # a move (or a departure) is under way: let the records settle first
        return plan_move(assignment, self.num_stages, self.threshold, stage_costs=self.stage_costs)

    def _mates_caught_up(self) -> bool:
        """Leave a stage only to mates that answer now and hold its current state: a mate still
        joining (or one whose step is unknown) could otherwise be left alone with an old state, and
        a mate that just died still counts as live for a few seconds (the liveness window): leaving
        then would empty the stage. A mate counts only if its latest poll succeeded, recently."""
        now = time.monotonic()
        mates = [m for m in self.peer.live_mates() if m.record_state == PeerState.ONLINE]
        step = self.peer.step
        ok = bool(mates) and all(
            m.last_info_ok
            and m.info_failures == 0
            and now - m.last_info_ok < MATE_ANSWERED_WITHIN_S
            and m.step >= step - 1
            for m in mates
        )
        if not ok:
            logger.info("not moving yet: the stage-mates have not caught up with step %d", step)
        return ok

    async def _round(self, urgent: bool = False) -> None:
        """One planned move, if this peer is the one to make it; `urgent` (before the period is up, in
        the cooldown): only a move that fills an empty stage (the swarm's throughput before it is 0)."""
        move = await self.plan()
        if move is None or move.peer_id != self.peer.peer_id or (urgent and move.before > 0):
            return
        if not self._mates_caught_up():
            return
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        confirmed = await self.plan()  # fresh records: still this peer, still this move?
        if confirmed is None or confirmed.peer_id != self.peer.peer_id or confirmed.dst != move.dst:
            return
        if not self._mates_caught_up():  # a mate may have died during the pause
            return
        await self.peer.move_to(move.dst, move.reason, move.before, move.after)

    async def run(self) -> None:
        next_round = time.monotonic() + self.period_s * self.rng.uniform(0.7, 1.3)
        while True:
            await asyncio.sleep(max(0.0, min(EMPTY_STAGE_CHECK_S, next_round - time.monotonic())))
            urgent = bool(empty_stages(self.peer.view, self.peer.stage, self.num_stages))
            if not urgent:
                if time.monotonic() < next_round:
                    continue
                next_round = time.monotonic() + self.period_s * self.rng.uniform(0.7, 1.3)
            if not self.peer.may_move(urgent):
                continue
            try:
                await self._round(urgent)
            except Exception:  # noqa: BLE001 - a failed round must not stop rebalancing or the peer
                logger.exception("rebalancing round failed")
