"""A peer's watch on its mates' accumulators (swarm.cluster.watch): the Info long poll that is
answered when a backward is accumulated, and the view side that keeps one per mate."""

import asyncio

import pytest

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.cluster.watch import MateWatch
from swarm.core.states import PeerState
from swarm.policy.polling import WATCH_MAX_MATES
from swarm.policy.wiring import PeerLoad
from swarm.wire.protocol import pb
from tests.unit.stage_service import Context, backward_request, last_stage


def _watch(step: int, samples: int, wait_ms: int) -> bytes:
    return pb.InfoRequest(watch=True, seen_step=step, seen_samples=samples, wait_ms=wait_ms).SerializeToString()


@pytest.mark.timeout(60)
def test_a_watch_is_answered_when_a_backward_is_accumulated():
    """A real StageService and executor: a watch that has seen (step 0, 0 samples) waits while nothing
    changes, is answered the moment a backward is accumulated (not after its 5 s), and a watch whose
    view is stale is answered at once."""
    service, executor = last_stage()
    ctx = Context()

    async def go():
        loop = asyncio.get_running_loop()
        first = pb.InfoResponse.FromString(await service.info(pb.InfoRequest().SerializeToString(), ctx))
        assert (first.step, first.samples_accumulated) == (0, 0)
        waiting = asyncio.ensure_future(service.info(_watch(0, 0, 5000), ctx))
        await asyncio.sleep(0.2)
        assert not waiting.done(), "nothing changed: the watch is held"
        t0 = loop.time()
        await service.backward(backward_request(3), ctx)
        answer = pb.InfoResponse.FromString(await asyncio.wait_for(waiting, 2.0))
        assert answer.samples_accumulated == 3 and loop.time() - t0 < 2.0
        t0 = loop.time()
        await service.info(_watch(0, 3, 300), ctx)  # seen what is there: held until its wait ends
        assert loop.time() - t0 >= 0.25
        t0 = loop.time()
        stale = pb.InfoResponse.FromString(await service.info(_watch(0, 1, 5000), ctx))
        assert stale.samples_accumulated == 3 and loop.time() - t0 < 1.0

    try:
        asyncio.run(go())
    finally:
        executor.stop()


class _ScriptedClient:
    """A mate whose accumulator changes as scripted: each watch is answered with the next state."""

    def __init__(self, states: list[tuple[int, int]]) -> None:
        self.states, self.seen, self.plain = list(states), [], 0

    def set_lane(self, port: int) -> None:
        pass

    async def info(self, timeout, wait_for_step=0, wait_s=0.0, accused=(), seen=None):
        if seen is None:
            self.plain += 1
        else:
            self.seen.append(seen)
        if seen is not None and not self.states:
            await asyncio.sleep(wait_s)  # nothing changes any more: held for the whole wait
        step, samples = self.states.pop(0) if self.states else seen
        return pb.InfoResponse(peer_id="m1", stage=0, state="online", step=step, samples_accumulated=samples)


class _Clients:
    def __init__(self, client) -> None:
        self.client = client

    def get(self, address: str):
        return self.client


@pytest.mark.timeout(30)
def test_mate_watch_passes_on_each_change_and_replaces_the_periodic_polls():
    """The view's watch asks with what it last heard, hands each answer to the listeners (the step
    decision, the partial sums' fetcher), the periodic poll leaves a watched mate alone, and a mate
    that left the polled stages is no longer watched."""
    client = _ScriptedClient([(0, 0), (0, 8), (0, 16), (1, 0)])

    async def go():
        view = SwarmView(dht=None, num_stages=2, clients=_Clients(client))
        view.peers["m1"] = PeerStatus(PeerLoad("m1", 0, "addr"), record_state=PeerState.ONLINE)
        view.poll_stages = {0}
        heard: list[tuple[int, int]] = []
        view.info_listeners.append(lambda: heard.append((view.peers["m1"].step, view.peers["m1"].samples_accumulated)))
        watch = MateWatch(view, view.notify_answers)
        task = asyncio.create_task(watch.run())
        try:
            async with asyncio.timeout(10):
                while len(heard) < 4:
                    await asyncio.sleep(0.01)
            assert heard[:4] == [(0, 0), (0, 8), (0, 16), (1, 0)]
            assert client.plain == 1 and client.seen[:3] == [(0, 0), (0, 8), (0, 16)]
            assert view.watched == {"m1"}
            calls = client.plain + len(client.seen)
            view.peers["m1"].next_poll = 0.0
            await view.poll_info(due_only=True)  # due, but watched: not polled again
            assert client.plain + len(client.seen) == calls
            view.poll_stages = {1}  # this peer moved to stage 1: its old mate is not watched
            async with asyncio.timeout(5):
                while view.watched:
                    await asyncio.sleep(0.01)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert view.watched == set()

    asyncio.run(go())


def test_a_large_stage_is_polled_not_watched():
    """Watches are not stretched by the answer budget: a peer with more than WATCH_MAX_MATES mates
    polls them at the budgeted period instead."""

    async def go():
        view = SwarmView(dht=None, num_stages=1, clients=_Clients(_ScriptedClient([])))
        view.poll_stages = {0}
        for i in range(WATCH_MAX_MATES + 1):
            view.peers[f"m{i}"] = PeerStatus(PeerLoad(f"m{i}", 0, "addr"), record_state=PeerState.ONLINE)
        watch = MateWatch(view, view.notify_answers)
        watch._sync()
        assert view.watched == set()
        del view.peers["m0"]
        watch._sync()
        assert len(view.watched) == WATCH_MAX_MATES
        watch._sync()  # nothing changed: the same watches
        for task in watch._watches.values():
            task.cancel()
        await asyncio.gather(*watch._watches.values(), return_exceptions=True)

    asyncio.run(go())


@pytest.mark.timeout(60)
def test_an_exact_mode_request_waiting_for_the_next_step_is_released_by_the_apply(monkeypatch):
    """A request for the step after this peer's waits (exact mode: its mate applied the update a
    moment earlier); it goes on as soon as the update is applied here (the apply's notify_step wakes
    it), and fails with StepNotReady after `step_wait_s` when the update never comes."""
    from swarm.core.errors import StepNotReady
    from swarm.peer import server

    monkeypatch.setattr(server, "STEP_RECHECK_S", 10.0)  # only the apply's wake-up can release it in time
    service, executor = last_stage()
    service.serving.step_wait_s = 20.0

    async def go():
        waiting = asyncio.ensure_future(service._wait_for_step(executor, 1))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        executor.step = 1  # what applying update 0 does, on the compute thread
        service.serving.notify_step()
        await asyncio.wait_for(waiting, 5.0)
        service.serving.step_wait_s = 0.2
        monkeypatch.setattr(server, "STEP_RECHECK_S", 0.05)
        with pytest.raises(StepNotReady):
            await service._wait_for_step(executor, 2)

    try:
        asyncio.run(go())
    finally:
        executor.stop()
