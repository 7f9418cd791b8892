"""How often a view polls a peer's Info and re-reads the DHT's stage records, so that the cost to
whoever answers stays bounded as the swarm grows.

Fixed periods make a peer answer (stage-mates + trainers) / INFO_PERIOD_S polls a second: 10 per
poller, so a stage of 100 peers polled by 100 trainers costs each peer 2,000 answers a second. Here
a peer tells its pollers, in every Info answer, the period that keeps it under INFO_BUDGET_PER_S
answers a second (pollers / budget, never below the base period), and each poller follows it; the
DHT period stretches likewise with the number of readers of each record. Polling cost per peer is
then constant beyond budget x period pollers, at the price of views that are as many times staler.
Pure functions: the peers, the views and the simulator (swarm.sim.overheads) share them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

INFO_BUDGET_PER_S = 100.0  # Info answers a second a peer asks its pollers to stay under (~2.5% of a core)
DHT_READ_BUDGET_PER_S = 100.0  # reads of one stage record a second each of its replicas serves at most
DHT_REPLICAS = 5  # replicas of a DHT record (hivemind's default num_replicas)
DHT_BUDGET_BYTES_PER_S = 50e6 / 8  # bytes a second each replica of a stage record serves at most (50 Mbit/s)
DHT_ENTRY_BYTES = 900.0  # one peer's signed entry in its stage record (owner key and signature included)
POLLERS_WINDOW_S = 2.0  # a poller not heard from for this long no longer counts
# a peer's watch on its stage-mates' accumulators (swarm.cluster.watch): long polls answered on change
WATCH_WAIT_S = 1.0  # a watched mate answers at the latest after this long, changed or not
WATCH_GAP_S = 0.01  # least time between two watch polls of one mate, whatever it answers
WATCH_MAX_MATES = 16  # a peer with more stage-mates polls them at the budgeted period instead
# a view's DHT reads while the records do not change (swarm.cluster.dht_reads)
QUIET_AFTER = 3  # reads in a row that changed nothing before the period stretches
QUIET_FACTOR = 3.0  # the stretched period, in base periods
MIN_GAP_S = 0.5  # least time between two reads, however often one is asked for (a view missing a peer)


def watches_mates(mates: int) -> bool:
    """Whether a peer with `mates` stage-mates watches them instead of polling them. Each watch is
    answered once per WATCH_WAIT_S and once per change of the mate's count, which the answer budget
    cannot stretch: only small stages watch (a peer of a stage of 17 answers at most 16 watches)."""
    return 0 < mates <= WATCH_MAX_MATES


def info_period(pollers: int, base_s: float, budget_per_s: float = INFO_BUDGET_PER_S) -> float:
    """The period each of `pollers` pollers should poll one peer at."""
    return max(base_s, pollers / budget_per_s)


def dht_period(
    readers: int,
    record_bytes: float,
    base_s: float,
    replicas: int = DHT_REPLICAS,
    reads_per_s: float = DHT_READ_BUDGET_PER_S,
    bytes_per_s: float = DHT_BUDGET_BYTES_PER_S,
) -> float:
    """The period each of `readers` processes should re-read every stage record (of `record_bytes`)
    at, so that no replica serves more than its budget of reads or bytes."""
    return max(base_s, readers / (replicas * reads_per_s), readers * record_bytes / (replicas * bytes_per_s))


@dataclass(frozen=True)
class ReadRhythm:
    """How a view's DHT reads come, on average, at a given rate of news."""

    mean_s: float  # between two reads
    quiet_share: float  # of the time, spent in stretched (quiet) periods


def dht_read_rhythm(
    base_s: float, changes_per_s: float, quiet_after: int = QUIET_AFTER, quiet_factor: float = QUIET_FACTOR
) -> ReadRhythm:
    """The steady state of swarm.cluster.dht_reads when the stage records change as a Poisson process
    of `changes_per_s` (each change is news to every view). A view reads every `base_s` until
    `quiet_after` reads in a row found no news, then every `quiet_factor` x `base_s` until one does.
    Per visit to "just found news", the view makes sum p^i (i < quiet_after) reads at the base period,
    p = exp(-rate x base), then p^quiet_after / (1 - q) stretched ones, q = exp(-rate x factor x base)."""
    if quiet_factor <= 1.0:
        return ReadRhythm(base_s, 0.0)
    p = math.exp(-changes_per_s * base_s)
    stay = math.exp(-changes_per_s * quiet_factor * base_s)
    if stay >= 1.0:  # nothing ever changes: every read is a quiet one
        return ReadRhythm(quiet_factor * base_s, 1.0)
    busy_reads = sum(p**i for i in range(quiet_after))
    quiet_reads = p**quiet_after / (1.0 - stay)
    busy_s, quiet_s = busy_reads * base_s, quiet_reads * quiet_factor * base_s
    return ReadRhythm((busy_s + quiet_s) / (busy_reads + quiet_reads), quiet_s / (busy_s + quiet_s))


class PollerCount:
    """The distinct processes polling this peer lately (one gRPC connection each: its address). The
    window stretches with the period this count asks for (twice it), or pollers that follow a long
    period would drop out of the count between their polls and the count would cap itself."""

    def __init__(self, window_s: float = POLLERS_WINDOW_S, budget_per_s: float = INFO_BUDGET_PER_S) -> None:
        self.window_s, self.budget_per_s = window_s, budget_per_s
        self._last: dict[str, float] = {}
        self._pruned = 0.0

    def seen(self, who: str, now: float | None = None) -> int:
        """Note a poll from `who`; returns how many distinct pollers polled within the window."""
        now = time.monotonic() if now is None else now
        self._last[who] = now
        window = max(self.window_s, 2 * len(self._last) / self.budget_per_s)
        if now - self._pruned > self.window_s / 4:
            self._pruned = now
            self._last = {k: t for k, t in self._last.items() if now - t <= window}
        return len(self._last)
