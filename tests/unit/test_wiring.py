"""The wiring policy: faster peers get proportionally more microbatches; banned peers get none."""

import heapq
import random

import pytest

from swarm.policy.wiring import BanPolicy, PeerLoad, Wiring


def simulate(throughputs: list[float], tasks: int, concurrency: int, seed: int = 0) -> list[int]:
    """Discrete-event run of `tasks` equal microbatches over peers of the given speeds."""
    wiring = Wiring(random.Random(seed))
    peers = [PeerLoad(f"p{i}", 0, f"a{i}", throughput=t) for i, t in enumerate(throughputs)]
    busy_until = [0.0] * len(peers)
    events: list[tuple[float, int]] = []
    now, started = 0.0, 0
    while started < tasks or events:
        while started < tasks and len(events) < concurrency:
            p = wiring.choose(peers, 1.0, now)
            i = peers.index(p)
            p.in_flight += 1
            busy_until[i] = max(busy_until[i], now) + 1.0 / p.throughput
            heapq.heappush(events, (busy_until[i], i))
            started += 1
        now, i = heapq.heappop(events)
        peers[i].in_flight -= 1
    return [p.assigned for p in peers]


def test_faster_peers_get_proportionally_more():
    speeds = [1.0, 2.0, 4.0, 8.0]
    counts = simulate(speeds, tasks=3000, concurrency=30)
    total = sum(counts)
    for speed, count in zip(speeds, counts, strict=True):
        assert count / total == pytest.approx(speed / sum(speeds), abs=0.03)


def test_equal_peers_share_evenly_with_random_tie_break():
    counts = simulate([5.0, 5.0, 5.0], tasks=3000, concurrency=1, seed=3)
    assert min(counts) > 900, counts  # ties broken at random: no peer starves


def test_banned_peer_gets_nothing_until_ban_ends():
    wiring = Wiring(random.Random(0), BanPolicy(base_s=2.0, max_s=60.0))
    fast = PeerLoad("fast", 0, "a", throughput=100.0)
    slow = PeerLoad("slow", 0, "b", throughput=1.0)
    assert wiring.choose([fast, slow], 1, now=0.0) is fast
    assert wiring.on_failure(fast, now=0.0) == 2.0
    for t in (0.0, 1.0, 1.99):
        assert wiring.choose([fast, slow], 1, now=t) is slow
    assert wiring.choose([fast, slow], 1, now=2.0) is fast


def test_ban_back_off_grows_and_resets():
    wiring = Wiring(random.Random(0), BanPolicy(base_s=1.0, max_s=10.0))
    p = PeerLoad("p", 0, "a")
    assert [wiring.on_failure(p, 0.0) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    wiring.on_success(p)
    assert wiring.on_failure(p, 0.0) == 1.0
    assert p.total_failures == 7


def test_no_eligible_peer_and_exclusion():
    wiring = Wiring(random.Random(0))
    a, b = PeerLoad("a", 0, "x"), PeerLoad("b", 0, "y", online=False)
    assert wiring.choose([b], 1, 0.0) is None
    assert wiring.choose([a, b], 1, 0.0, exclude={"a"}) is None
    assert wiring.choose([a, b], 1, 0.0) is a


def test_end_to_end_throughput_limits_a_fast_peer_behind_a_slow_link():
    gpu_slow_link = PeerLoad("g", 0, "x", throughput=100.0, e2e_throughput=2.0)
    cpu_fast_link = PeerLoad("c", 0, "y", throughput=10.0, e2e_throughput=10.0)
    assert Wiring(random.Random(0)).choose([gpu_slow_link, cpu_fast_link], 1, 0.0) is cpu_fast_link


def test_a_peer_claiming_more_than_it_delivers_gets_work_by_what_it_delivers():
    """A lying throughput claim (1,000 samples/s, delivering 5) draws no more work than its delivery
    earns: loaded with queued work as calls pile up, it gets about 5/(5+10) of the tasks."""
    wiring = Wiring(random.Random(0))
    liar = PeerLoad("liar", 0, "x", throughput=1000.0, e2e_throughput=5.0)
    honest = PeerLoad("honest", 0, "y", throughput=10.0, e2e_throughput=10.0)
    chosen = {"liar": 0, "honest": 0}
    for _ in range(300):
        peer = wiring.choose([liar, honest], 1, 0.0)
        chosen[peer.peer_id] += 1
        peer.in_flight += 1  # the calls pile up: each peer's queue grows by its share
    assert chosen["liar"] < 0.45 * 300 and chosen["honest"] > 0.55 * 300, chosen
