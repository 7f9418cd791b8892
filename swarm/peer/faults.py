"""Where a peer's injected fault (swarm.core.debug.FaultPlan, tests only) fires, and the leave fault.

Three places: the step loop (the default: the stage reached the step), the first training request
served from that step on (`in_request`: a call is in flight when it strikes), and a stage-mate's
fetch of this peer's frozen sum for update step - 1 or later, a sum of some samples (`in_mate_fetch`):
the fetch is held until
this peer has applied that update, then the fault fires, so the peer dies having applied an update
its mate never got its sum for (the mate's round fails and the trainers replay to it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from swarm.core.debug import LEAVE, FaultPlan

logger = logging.getLogger(__name__)

FAULT_LEAVE_HOLD_S = 2.0  # the leave fault: how long the peer looks online with its compute stopped
APPLY_WAIT_S = 10.0  # in_mate_fetch: how long the held fetch waits for this peer's own apply
APPLY_POLL_S = 0.005


class PeerFaults:
    """Fires `plan` once (a stopped process carries on after SIGCONT) at its place."""

    def __init__(self, plan: FaultPlan, membership_of: Callable[[], object], keep_task: Callable) -> None:
        self.plan = plan
        self._membership_of = membership_of  # the peer's Membership (swarm.peer.membership), once started
        self._keep_task = keep_task  # the daemon keeps (and cancels on shutdown) a background task
        self.leaving: asyncio.Task | None = None  # the leave fault, fired in a request

    @property
    def compute_stopped(self) -> bool:
        """The leave fault stopped the compute and the peer has not moved yet: no update until then."""
        return self.leaving is not None and not self.leaving.done()

    async def at_step_loop(self, step: int) -> None:
        if self.plan.at_step_loop and self.plan.due(step):
            await self._inject()

    async def before_compute(self, step: int) -> None:
        """Before a training request is computed at `step` (ServingState.before_compute)."""
        if self.plan.due(step):
            await self._inject(in_request=True)

    async def before_mate_fetch(self, executor, step: int) -> None:
        """A mate fetches this peer's frozen sum of update `step` (ServingState.before_mate_fetch)."""
        if not self.plan.due(step + 1) or not executor.acc.samples_for(step):
            return  # a sum of no samples lost costs nothing: wait for an update it holds a part of
        deadline = time.monotonic() + APPLY_WAIT_S
        while executor.step <= step and time.monotonic() < deadline:
            await asyncio.sleep(APPLY_POLL_S)
        if executor.step > step:
            logger.warning("fault injection: update %d applied here, a mate still fetching its sum", step)
            await self._inject(in_request=True)

    async def _inject(self, in_request: bool = False) -> None:
        m, plan = self._membership_of(), self.plan
        if plan.fail_mode != LEAVE:
            plan.inject(m.step)
            return
        plan.fail_at_step = None  # once
        logger.warning("fault injection: the compute stops at step %d while this peer still looks online", m.step)
        # requests now fail with ExecutorStopped: UNAVAILABLE, and the trainers retry elsewhere
        await asyncio.get_running_loop().run_in_executor(None, m.executor.stop)
        leave = self._leave_after_hold(m)
        if in_request:  # the request goes on (and fails UNAVAILABLE); the move follows in the background
            self.leaving = asyncio.create_task(leave)
            self._keep_task(self.leaving)
        else:
            await leave

    async def _leave_after_hold(self, m) -> None:
        await asyncio.sleep(FAULT_LEAVE_HOLD_S)
        dst = (m.stage + 1) % m.run.num_stages
        await m.move_to(dst, "fault injection: leave", 0.0, 0.0)
