"""A peer's watch on its stage-mates' accumulators: one Info long poll per mate, answered the moment
that mate accumulates a backward or applies an update (`InfoRequest.watch`), in place of the
periodic polls.

Why: the stage's step decision adds the mates' counts to its own (swarm.peer.stepping), and the
async look-ahead fetches a mate's partial sum when its count grows (swarm.peer.partials). Polled
every 0.25 s, a count arrived up to a period late: when a step's last two microbatches landed on two
mates, neither saw the batch complete until one of them polled the other, and a mate's sum mostly
arrived after the run-ahead microbatches it was meant for (docs/BENCHMARKS.md, "Mates watch each
other's accumulators").

Cost: one answer per change of a mate's (step, samples accumulated), at most one per WATCH_GAP_S,
and one per WATCH_WAIT_S without a change (which keeps the mate live in the view: is_live), instead
of one per Info period. That is not stretched by the answer budget (swarm.policy.polling), so only a
peer with at most WATCH_MAX_MATES mates watches them; in a larger stage it polls them as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from swarm.core.states import PeerState
from swarm.policy.polling import WATCH_GAP_S, WATCH_WAIT_S, watches_mates

logger = logging.getLogger(__name__)


class WatchedView(Protocol):
    """What the watch needs of the view (swarm.cluster.view.SwarmView; not imported: it imports this)."""

    peers: dict
    poll_stages: set[int] | None
    info_period_s: float
    watched: set[str]

    async def poll_one(self, status, wait_for_step: int = 0, wait_s: float = 0.0, watch: bool = False) -> bool: ...


class MateWatch:
    """Keeps one watch (a sequence of long polls) on each known peer of the view's polled stages."""

    def __init__(self, view: WatchedView, on_answer: Callable[[], None]) -> None:
        self.view, self.on_answer = view, on_answer
        self._watches: dict[str, asyncio.Task] = {}  # peer id -> its watch
        self.answers = 0

    async def run(self) -> None:
        """Start and stop watches as peers come, go and move (at the view's Info period)."""
        try:
            while True:
                self._sync()
                await asyncio.sleep(self.view.info_period_s)
        finally:
            for task in self._watches.values():
                task.cancel()
            await asyncio.gather(*self._watches.values(), return_exceptions=True)
            self._watches.clear()
            self.view.watched = set()

    def _sync(self) -> None:
        stages = self.view.poll_stages
        wanted = {
            pid
            for pid, s in self.view.peers.items()
            if stages is not None and s.stage in stages and s.record_state != PeerState.OFFLINE
        }
        if not watches_mates(len(wanted)):
            wanted = set()  # a large stage: its mates are polled at the budgeted period
        for pid, task in list(self._watches.items()):
            if pid not in wanted or task.done():
                task.cancel()
                del self._watches[pid]
        for pid in wanted - set(self._watches):
            self._watches[pid] = asyncio.create_task(self._watch(pid))
        self.view.watched = set(self._watches)

    async def _watch(self, peer_id: str) -> None:
        while True:
            status = self.view.peers.get(peer_id)  # replaced when the peer moves or changes address
            if status is None:
                return
            answered = await self.view.poll_one(status, wait_s=WATCH_WAIT_S, watch=True)
            self.answers += answered
            try:
                self.on_answer()
            except Exception:  # noqa: BLE001 - a listener must not end the watch
                logger.exception("watch listener failed")
            await asyncio.sleep(WATCH_GAP_S if answered else self.view.info_period_s)


__all__ = ["MateWatch"]
