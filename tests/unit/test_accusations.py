"""When a peer reads the accusations (swarm.cluster.accusations): when a poller names an accused member
of its stage it has not read of, not before every update; an update waits for a read in flight."""

import asyncio

import pytest

import swarm.cluster.accusations as accusations
from swarm.cluster.accusations import AccusationReads


class Dht:
    """What the view's accusations read does: a DHT get that takes `delay_s`, then the accused known."""

    def __init__(self, delay_s: float = 0.02) -> None:
        self.delay_s, self.reads, self.stored, self.known = delay_s, 0, set(), set()

    async def read(self) -> None:
        self.reads += 1
        seen = set(self.stored)  # what the DHT holds when the read starts
        await asyncio.sleep(self.delay_s)
        self.known |= seen


def reads_for(dht: Dht, members: set[str]) -> AccusationReads:
    return AccusationReads(dht.read, lambda: members - dht.known)


def test_no_read_without_a_hint_and_none_for_peers_outside_the_stage():
    async def run() -> int:
        dht = Dht()
        reads = reads_for(dht, {"me", "mate"})
        await reads.wait()  # an update with nothing in flight: no read
        assert not reads.hint(["elsewhere"])  # another stage's peer: not this stage's business
        assert not reads.hint([])
        await reads.wait()
        return dht.reads

    assert asyncio.run(run()) == 0


def test_a_hint_about_a_mate_starts_a_read_and_the_next_update_waits_for_it():
    async def run() -> None:
        dht = Dht(delay_s=0.1)
        dht.stored.add("mate")
        reads = reads_for(dht, {"me", "mate"})
        assert reads.hint(["elsewhere", "mate"])
        await reads.wait()  # the update that follows the hint
        assert dht.known == {"mate"} and dht.reads == 1
        assert not reads.hint(["mate"])  # known now: no more reads for it
        assert reads.hint(["me"])  # not stored (a lost store, a bogus hint): read once ...
        await reads.wait()
        assert dht.reads == 2 and dht.known == {"mate"}
        assert not reads.hint(["me"])  # ... and not again within HINT_RETRY_S

    asyncio.run(run())


def test_a_hint_during_a_read_that_began_before_the_store_reads_once_more():
    async def run() -> None:
        dht = Dht(delay_s=0.1)
        reads = reads_for(dht, {"me", "mate"})
        reads.start()  # a read in flight (e.g. an earlier hint) ...
        await asyncio.sleep(0.01)
        dht.stored.add("mate")  # ... when the accusation is stored and a poller says so
        assert reads.hint(["mate"])
        await reads.wait()
        assert dht.reads == 2 and dht.known == {"mate"}

    asyncio.run(run())


def test_a_bogus_or_repeated_hint_reads_at_most_once_per_retry_period(monkeypatch):
    """A poller cannot make a peer read the DHT on every poll: an id read for and not found is not read
    for again within HINT_RETRY_S; oversize ids and more than MAX_HINT_IDS per request are ignored."""

    async def run() -> None:
        dht = Dht(delay_s=0.0)
        reads = reads_for(dht, {"me", "mate"})
        for _ in range(50):
            reads.hint(["mate"])
            await reads.wait()
        assert dht.reads == 1
        monkeypatch.setattr(accusations, "HINT_RETRY_S", 0.0)
        assert reads.hint(["mate"])
        await reads.wait()
        assert dht.reads == 2
        assert not reads.hint(["x" * 200])
        assert not reads.hint([f"other{i}" for i in range(accusations.MAX_HINT_IDS)] + ["mate"])

    asyncio.run(run())


def test_a_slow_read_holds_an_update_for_at_most_the_wait(monkeypatch):
    monkeypatch.setattr(accusations, "WAIT_S", 0.05)

    async def run() -> None:
        dht = Dht(delay_s=1.0)
        reads = reads_for(dht, {"me", "mate"})
        reads.hint(["mate"])
        loop = asyncio.get_running_loop()
        began = loop.time()
        await reads.wait()
        assert loop.time() - began < 0.5 and reads.slow_reads == 1

    asyncio.run(run())


@pytest.mark.parametrize("size", [0, 1, accusations.MAX_REMEMBERED + 10])
def test_remembered_hints_are_bounded(size):
    async def run() -> int:
        ids = {f"p{i}" for i in range(size)}
        reads = reads_for(Dht(delay_s=0.0), ids)
        for peer_id in sorted(ids):
            reads.hint([peer_id])
        await reads.wait()
        return len(reads._hinted)

    assert asyncio.run(run()) == min(size, accusations.MAX_REMEMBERED)


def test_a_trainers_view_reads_the_accusations_when_an_info_answer_names_an_unknown_accused():
    """A trainer's view reads them at once when a peer's Info answer names a peer accused that it does
    not know (and not again once known); its own Info polls name those it knows."""
    from swarm.cluster.view import PeerStatus, SwarmView
    from swarm.core.states import PeerState
    from swarm.dht.records import Accusation, AccusationRecord
    from swarm.policy.wiring import PeerLoad
    from swarm.wire.protocol import pb

    accusation = Accusation(
        accused="p2", stage=0, step=3, kind="forward", input_digest="", accused_digest="", majority_digest="",
        error=1.0, witnesses=[], time=0.0,
    )  # fmt: skip

    class FakeDht:
        timeout = 1.0
        reads = 0

        def read_view(self, num_stages):
            return {}, []

        def get_accusations(self):
            self.reads += 1
            return [AccusationRecord(trainer_id="t1", accusations=[accusation])]

    class Client:
        sent: list = []

        def set_lane(self, port):
            pass

        async def info(self, timeout, wait_for_step=0, wait_s=0.0, accused=(), seen=None):
            self.sent.append(list(accused))
            return pb.InfoResponse(peer_id="p1", stage=0, state="online", accused=["p2"])

    class Clients:
        def get(self, address):
            return Client()

    async def run() -> tuple[int, list]:
        dht = FakeDht()
        view = SwarmView(dht=dht, num_stages=1, clients=Clients())
        for peer_id in ("p1", "p2"):
            view.peers[peer_id] = PeerStatus(PeerLoad(peer_id, 0, "addr"), record_state=PeerState.ONLINE)
        idle = asyncio.Event().wait
        view._dht_loop, view._info_loop = idle, idle  # polled by hand below, DHT records kept as set
        view.start(read_hinted_accusations=True)
        try:
            await view.poll_info({0})
            await view.hinted_reads.wait()
            assert "p2" in view.accused
            await view.poll_info({0})  # known now: no read
            await view.hinted_reads.wait()
        finally:
            await view.stop()
        return dht.reads, Client.sent

    reads, sent = asyncio.run(run())
    assert reads == 1
    assert sent[0] == [] and sent[-1] == ["p2"]  # its polls name what it knows
