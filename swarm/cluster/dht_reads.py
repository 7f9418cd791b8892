"""When a view re-reads the DHT's stage records: at its base period while they change, slower while
they do not, and soon when the view finds it is missing something.

Every process of a swarm re-reads every stage record (the peers' own, the trainers', the
coordinator's views), and every peer re-publishes its record: in a 3x4 local swarm with 2 trainers
on 2 cores those reads and stores took a quarter of the CPU (the 12 peers' DHT processes and p2pd
daemons, scripts/cpu_by_role.py; docs/BENCHMARKS.md "Overload"). What a view needs quickly from the
DHT is news (a peer that joined, moved or left); between news the records only repeat themselves. So
a read that changed nothing counts, and after QUIET_AFTER of them in a row the period is QUIET_FACTOR
times the base. The moments that cannot wait ask for a read (`want`), taken after MIN_GAP_S at the
latest: a trainer with no usable peer in a stage or waiting for the stages at start-up, a held
gradient whose holder it has not discovered, a peer whose Info names another stage than its record,
a stage short of its batch for a while (a new mate holds samples its mates have not discovered).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Hashable

from swarm.dht.records import AccusationRecord, PeerEntry

# shared with the simulator (swarm.sim.overheads)
from swarm.policy.polling import MIN_GAP_S, QUIET_AFTER, QUIET_FACTOR


def signature(records: dict[int, list[PeerEntry]], accusations: list[AccusationRecord]) -> Hashable:
    """What a read found that is news when it changes: each record's peer, stage, address and state
    (not its throughput or step, which Info keeps fresh), and the accused peers."""
    peers = frozenset((e.record.peer_id, k, e.record.address, e.record.state) for k, es in records.items() for e in es)
    return peers, frozenset(a.accused for r in accusations for a in r.accusations)


class DhtReads:
    def __init__(
        self, quiet_after: int = QUIET_AFTER, quiet_factor: float = QUIET_FACTOR, min_gap_s: float = MIN_GAP_S
    ) -> None:
        self.quiet_after, self.quiet_factor, self.min_gap_s = quiet_after, quiet_factor, min_gap_s
        self.unchanged = 0  # reads in a row that found what the one before found
        self.asked = 0  # reads asked for (`want`), for counters and tests
        self._signature: Hashable | None = None
        self._wanted = asyncio.Event()

    def begin(self) -> None:
        """A read starts: what was asked for before now, it answers."""
        self._wanted.clear()

    def after(self, signature: Hashable) -> None:
        """A read ended with `signature` (what it found that matters: peers, stages, states)."""
        self.unchanged = self.unchanged + 1 if signature == self._signature else 0
        self._signature = signature

    def failed(self) -> None:
        """A read failed: not quiet, so the next one comes at the base period."""
        self.unchanged = 0

    @property
    def quiet(self) -> bool:
        return self.unchanged >= self.quiet_after

    def period(self, base_s: float) -> float:
        return base_s * self.quiet_factor if self.quiet else base_s

    def want(self) -> None:
        """Read again soon: this view found it is missing something."""
        if not self._wanted.is_set():
            self.asked += 1
            self._wanted.set()

    async def wait(self, base_s: float) -> None:
        """Until the next read: the period from now, or MIN_GAP_S when a read is (or was) asked for."""
        await asyncio.sleep(self.min_gap_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, self.period(base_s) - self.min_gap_s)):
                await self._wanted.wait()


__all__ = ["DhtReads", "MIN_GAP_S", "QUIET_AFTER", "QUIET_FACTOR", "signature"]
