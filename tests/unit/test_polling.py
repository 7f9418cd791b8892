"""Polling that stays within each peer's budget: the periods peers ask for, how a peer counts its
pollers, and a view that follows the period each peer asks for."""

import asyncio
import time

import pytest

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.core.settings import INFO_PERIOD_S, LIVENESS_WINDOW_S
from swarm.core.states import PeerState
from swarm.policy.polling import INFO_BUDGET_PER_S, PollerCount, dht_period, info_period
from swarm.policy.wiring import PeerLoad
from swarm.wire.protocol import pb


def test_periods_stay_at_the_base_until_the_budget_binds():
    assert info_period(5, INFO_PERIOD_S) == INFO_PERIOD_S
    assert info_period(1000, INFO_PERIOD_S) == pytest.approx(1000 / INFO_BUDGET_PER_S)
    # answers a second to one peer: linear in its pollers up to the budget, then flat
    answers = [n / info_period(n, INFO_PERIOD_S) for n in (1, 10, 100, 1000, 10_000)]
    below = [1 / INFO_PERIOD_S, 10 / INFO_PERIOD_S]  # 4 and 40 a second at the 0.25 s base
    assert answers[:2] == pytest.approx(below) and answers[2:] == pytest.approx([INFO_BUDGET_PER_S] * 3)
    assert dht_period(10, 10 * 900, 2.0) == 2.0
    big = dht_period(10_000, 625 * 900, 2.0)  # 10,000 peers on 16 stages: the bytes bind
    assert big > 10_000 / (5 * 100) and 10_000 * 625 * 900 / big / 5 <= 50e6 / 8 * (1 + 1e-9)


def test_poller_count_forgets_pollers_gone_quiet():
    count = PollerCount(window_s=2.0)
    assert count.seen("a", now=0.0) == 1 and count.seen("b", now=0.1) == 2 and count.seen("a", now=0.2) == 2
    assert count.seen("c", now=3.0) == 1  # a and b were last heard over 2 s ago


class _Client:
    def __init__(self, answers: list):
        self.answers, self.calls, self.lane_port = answers, 0, None

    def set_lane(self, port: int) -> None:
        self.lane_port = port

    async def info(self, timeout: float, wait_for_step: int = 0, wait_s: float = 0.0, accused=(), seen=None):
        self.calls += 1
        self.accused = list(accused)
        return self.answers[0]


class _Clients:
    def __init__(self, client):
        self.client = client

    def get(self, address: str):
        return self.client


def test_view_polls_a_peer_at_the_period_it_asks_for():
    async def go():
        client = _Client([pb.InfoResponse(peer_id="p1", stage=0, state="online", poll_period_ms=2000)])
        view = SwarmView(dht=None, num_stages=1, clients=_Clients(client))
        status = PeerStatus(PeerLoad("p1", 0, "addr"), record_state=PeerState.ONLINE)
        view.peers["p1"] = status
        await view.poll_info(due_only=True)
        assert client.calls == 1 and status.poll_period_s == pytest.approx(2.0)
        assert client.lane_port == 0  # the answer named no lane: the client stays on gRPC
        for _ in range(5):  # the loop's next ticks: not due again for 2 s
            await view.poll_info(due_only=True)
        assert client.calls == 1
        await view.poll_info()  # an explicit refresh (a peer catching up) polls at once
        assert client.calls == 2
        # polled every 2 s, it stays live for 3 periods (6 s), beyond the 4 s window
        now = status.last_info_ok + LIVENESS_WINDOW_S + 1.0
        assert view.is_live(status, now) and not view.is_live(status, status.last_info_ok + 6.5)

    asyncio.run(go())


def test_a_long_poll_answers_when_the_step_changes():
    """A peer holds an Info long poll until its step reaches the one asked for (notify_step, after an
    update), or until the wait is over."""
    from swarm.peer.serving import ServingState

    class _Executor:
        step = 3

    async def go():
        serving = ServingState("run", "peer", "0")
        serving.executor = _Executor()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await serving.wait_for_step(3, 5.0)  # already there: at once
        assert loop.time() - t0 < 0.5
        waiter = asyncio.ensure_future(serving.wait_for_step(4, 5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        serving.executor.step = 4
        serving.notify_step()
        await asyncio.wait_for(waiter, 1.0)  # answered on the change, not after the 5 s
        t0 = loop.time()
        await serving.wait_for_step(9, 0.2)  # never reached: the wait ends
        assert 0.15 < loop.time() - t0 < 2.0

    asyncio.run(go())


def test_view_waits_for_the_global_step_with_long_polls():
    async def go():
        client = _Client([pb.InfoResponse(peer_id="p1", stage=0, state="online", step=5)])
        view = SwarmView(dht=None, num_stages=1, clients=_Clients(client))
        status = PeerStatus(PeerLoad("p1", 0, "addr"), record_state=PeerState.ONLINE, step=4)
        view.peers["p1"] = status
        assert await view.wait_for_step(5, 0.5) and client.calls == 1 and view.global_step() == 5
        assert not await view.wait_for_step(5, 0.5)  # nobody is below step 5: nothing to wait for
        assert client.calls == 1

    asyncio.run(go())


def test_poller_count_keeps_pollers_that_follow_a_long_period():
    """1000 pollers, each polling every 10 s (the period 1000 pollers are asked for): the count stays
    at 1000, so the period asked for stays 10 s (a fixed 2 s window would count about 200)."""
    count = PollerCount(window_s=2.0)
    n, now = 0, 0.0
    for rnd in range(3):
        for i in range(1000):
            now = rnd * 10.0 + i * 0.01
            n = count.seen(f"p{i}", now=now)
    assert n == 1000 and info_period(n, INFO_PERIOD_S) == pytest.approx(10.0)


@pytest.mark.timeout(60)
def test_a_peer_refusing_connections_is_dead_at_once_and_a_silent_one_only_after_the_window():
    """Real gRPC clients: a port nothing listens on (a killed peer) makes the peer not live at its
    first failed poll, so its mates and trainers stop counting it then instead of LIVENESS_WINDOW_S
    later; a peer that accepts the connection and never answers (SIGSTOPped) keeps the window."""
    from swarm.wire.pool import ClientPool

    async def go():
        silent = await asyncio.start_server(lambda r, w: asyncio.sleep(0), "127.0.0.1", 0)  # holds, never answers
        closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        closed_port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()
        pool = ClientPool()
        view = SwarmView(dht=None, num_stages=1, clients=pool, info_timeout_s=0.5)
        try:
            for pid, port in (("dead", closed_port), ("stopped", silent.sockets[0].getsockname()[1])):
                status = PeerStatus(PeerLoad(pid, 0, f"127.0.0.1:{port}"), record_state=PeerState.ONLINE)
                status.last_info_ok = time.monotonic()  # answered a moment ago
                view.peers[pid] = status
                assert view.is_live(status)
                assert not await view.poll_one(status)
            assert view.peers["dead"].refused and not view.is_live(view.peers["dead"])
            assert not view.peers["stopped"].refused and view.is_live(view.peers["stopped"])
            assert [s.peer_id for s in view.stage_peers(0)] == ["stopped"]
        finally:
            await pool.close()
            silent.close()

    asyncio.run(go())
