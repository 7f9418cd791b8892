"""When a process reads the accusations of lying peers (one DHT get): when it is told of one it has
not read, not on a timer or before every update.

A trainer that publishes an accusation polls the Info of the accused's stage at once, and every Info
poll (a trainer's, a stage-mate's) names the accused peers its poller knows (`InfoRequest.accused`);
every Info answer names those its peer knows (`InfoResponse.accused`). A peer told of a member of its
stage (itself included) that it does not know accused reads the accusations at once, and its next
update waits for that read (swarm.peer.stepping), so the accused is left out of it; a trainer told of
any peer it does not know accused reads them at once and stops sending it work. Every view re-reads
them with the stage records besides (every 2 s, or 6 s while nothing changes: swarm.cluster.dht_reads):
a hint lost with its sender costs at most that. A hint
is only a reason to read; what counts is the trainer-signed record the DHT returns.

Reading before every update (a DHT get per update per peer) and every 0.5 s in each trainer was the
largest part of a swarm's DHT traffic: a 3x4 local swarm ran at 25-34 samples/s with the peers' reads
and 40.4-40.6 without them (docs/BENCHMARKS.md, "Overload").
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable

logger = logging.getLogger(__name__)

# how long an update waits for a read in flight: a DHT with a dead node in its routes (the coordinator
# or a peer just killed, a cut link) answers a get only after hivemind's 3 s RPC timeout; a read that
# takes longer goes on, and what it finds counts from the update after
WAIT_S = 0.5
# a hinted peer read for and not found (a lost store, a bogus hint) is not read for again this soon:
# a poller cannot make this peer read the DHT more than once per HINT_RETRY_S per member of its stage
HINT_RETRY_S = 2.0
MAX_HINT_IDS = 16  # a message names at most this many (the newest)
MAX_PEER_ID_CHARS = 128
MAX_REMEMBERED = 1024  # hinted ids remembered (bounded: old ones are dropped)


class AccusationReads:
    """The accusation reads of one process. `read` reads them into its view; `members()`: the ids a
    hint matters for, not known accused (a peer: its stage's live members, itself included; a
    trainer: every peer it knows)."""

    def __init__(self, read: Callable[[], Awaitable[None]], members: Callable[[], set[str]]) -> None:
        self._read, self._members = read, members
        self._task: asyncio.Task | None = None
        self._again = False  # a hint came while a read was in flight: read once more after it
        self._hinted: dict[str, float] = {}  # peer id -> when a hint about it started a read
        self.reads = 0
        self.slow_reads = 0

    def hint(self, accused: Iterable[str]) -> bool:
        """A message names peers accused. Start a read when one of them is in `members()` and was not
        read for within HINT_RETRY_S; True if it did."""
        now = time.monotonic()
        fresh = [
            p
            for p in list(accused)[:MAX_HINT_IDS]
            if len(p) <= MAX_PEER_ID_CHARS and now - self._hinted.get(p, -math.inf) >= HINT_RETRY_S
        ]
        if fresh:
            members = self._members()
            fresh = [p for p in fresh if p in members]
        if not fresh:
            return False
        for peer_id in fresh:
            self._hinted.pop(peer_id, None)
            self._hinted[peer_id] = now
        while len(self._hinted) > MAX_REMEMBERED:
            del self._hinted[next(iter(self._hinted))]
        logger.info("told of an accusation against %s: reading the accusations", ", ".join(p[-6:] for p in fresh))
        self.start()
        return True

    def start(self) -> None:
        """Read now; with a read in flight (it may have begun before the accusation was stored), once
        more after it."""
        if self._task is not None and not self._task.done():
            self._again = True
            return
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self._again = False
            self.reads += 1
            try:
                await self._read()
            except Exception as e:  # noqa: BLE001 - the view's periodic refresh reads them too
                logger.debug("reading the accusations failed: %s", e)
            if not self._again:
                return

    async def wait(self) -> None:
        """Wait for a read in flight, at most WAIT_S (before an update)."""
        task = self._task
        if task is None or task.done():
            return
        try:
            await asyncio.wait_for(asyncio.shield(task), WAIT_S)
        except TimeoutError:
            self.slow_reads += 1
            logger.info("reading the accusations takes over %.1f s: this update goes on with those read before", WAIT_S)
