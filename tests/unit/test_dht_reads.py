"""When a view re-reads the DHT (swarm.cluster.dht_reads): the base period while the records change,
slower after reads that changed nothing, soon when a read is asked for."""

from __future__ import annotations

import asyncio
import math
import random
import time

import pytest

from swarm.cluster.dht_reads import DhtReads
from swarm.policy.polling import QUIET_FACTOR, dht_read_rhythm

pytestmark = pytest.mark.timeout(30)


def test_the_period_stretches_after_reads_that_change_nothing_and_comes_back_on_news():
    reads = DhtReads(quiet_after=3, quiet_factor=3.0)
    reads.after({"a"})  # the first read is news
    assert reads.period(2.0) == 2.0
    for _ in range(2):
        reads.after({"a"})
    assert reads.period(2.0) == 2.0  # two unchanged reads: not quiet yet
    reads.after({"a"})
    assert reads.quiet and reads.period(2.0) == 6.0
    reads.after({"a", "b"})  # a peer joined
    assert not reads.quiet and reads.period(2.0) == 2.0


def test_a_wanted_read_comes_after_the_least_gap_not_the_period():
    async def main() -> tuple[float, float]:
        reads = DhtReads(min_gap_s=0.05)
        reads.begin()
        t0 = time.monotonic()
        asyncio.get_running_loop().call_later(0.1, reads.want)
        await reads.wait(20.0)  # would be 20 s without the want
        waited_wanted = time.monotonic() - t0
        reads.begin()  # the read answers the want
        t1 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await reads.wait(20.0)  # nothing asked since: the period holds
        return waited_wanted, time.monotonic() - t1

    waited_wanted, waited_period = asyncio.run(main())
    assert 0.09 <= waited_wanted < 5.0
    assert waited_period >= 0.29


def test_a_want_before_the_gap_ends_still_waits_the_gap_and_is_counted_once():
    async def main() -> float:
        reads = DhtReads(min_gap_s=0.2)
        reads.begin()
        reads.want()
        reads.want()  # asked twice before the read: one read
        t0 = time.monotonic()
        await reads.wait(20.0)
        assert reads.asked == 1
        return time.monotonic() - t0

    assert 0.19 <= asyncio.run(main()) < 5.0


def test_the_signature_changes_with_peers_stages_states_and_accusations_not_with_load():
    from types import SimpleNamespace as NS

    from swarm.cluster.dht_reads import signature

    def entry(peer: str, state: str = "online", throughput: float = 1.0, step: int = 0):
        address = f"127.0.0.1:{len(peer)}"
        return NS(record=NS(peer_id=peer, address=address, state=state, throughput=throughput, step=step))

    base = signature({0: [entry("a")], 1: [entry("b")]}, [])
    assert signature({0: [entry("a", throughput=9.0, step=7)], 1: [entry("b")]}, []) == base  # Info keeps these fresh
    assert signature({0: [entry("a")], 1: [entry("b"), entry("c")]}, []) != base  # joined
    assert signature({0: [], 1: [entry("a"), entry("b")]}, []) != base  # moved
    assert signature({0: [entry("a", state="draining")], 1: [entry("b")]}, []) != base
    accused = [NS(accusations=[NS(accused="b")])]
    assert signature({0: [entry("a")], 1: [entry("b")]}, accused) != base


def _read_rhythm_of_the_code(base_s: float, rate: float, reads: int, seed: int) -> tuple[float, float]:
    """(mean seconds between reads, share of the time in stretched periods) of a DhtReads driven by
    Poisson news of `rate` a second: each read's signature is the number of changes so far."""
    rng = random.Random(seed)
    state, now, next_change, changes = DhtReads(), 0.0, rng.expovariate(rate) if rate else math.inf, 0
    quiet_s = 0.0
    for _ in range(reads):
        wait = state.period(base_s)
        quiet_s += wait if state.quiet else 0.0
        now += wait
        while next_change <= now:
            changes += 1
            next_change += rng.expovariate(rate)
        state.after(changes)
    return now / reads, quiet_s / now


@pytest.mark.parametrize("rate", [0.0, 0.02, 0.1, 0.3, 2.0])
def test_the_simulators_read_rhythm_is_the_codes(rate):
    """swarm.policy.dht_read_rhythm (what swarm sim charges the DHT replicas and how late it lets the
    trainers find a new peer) against the real DhtReads under Poisson news: mean period and quiet share."""
    mean_s, quiet_share = _read_rhythm_of_the_code(2.0, rate, 40_000, seed=int(rate * 100))
    rhythm = dht_read_rhythm(2.0, rate)
    assert rhythm.mean_s == pytest.approx(mean_s, rel=0.03)
    assert rhythm.quiet_share == pytest.approx(quiet_share, abs=0.02)
    if rate >= 2.0:  # news at nearly every read: always the base period
        assert rhythm.mean_s == pytest.approx(2.0, rel=1e-3)
    if rate == 0.0:  # nothing ever changes: always the stretched one
        assert rhythm.mean_s == pytest.approx(2.0 * QUIET_FACTOR) and rhythm.quiet_share == 1.0
    assert dht_read_rhythm(2.0, rate, quiet_factor=1.0).mean_s == 2.0  # no stretching: the code before
