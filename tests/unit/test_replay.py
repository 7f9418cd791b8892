"""The trainer's replayer (swarm.trainer.replay) replays a held gradient when its holder dropped it,
and only on evidence newer than the holder's answer."""

import logging
import time

import torch

from swarm.cluster.dht_reads import DhtReads
from swarm.cluster.view import PeerStatus
from swarm.core.states import PeerState
from swarm.policy.wiring import PeerLoad
from swarm.trainer.microbatch import HeldBackward, Microbatch
from swarm.trainer.replay import Replayer
from swarm.wire.protocol import pb


class _View:
    """What the replayer reads of a trainer's view: peers by id, the accused, liveness."""

    def __init__(self, status: PeerStatus) -> None:
        self.peers = {"p": status}
        self.accused: dict = {}
        self.dht_reads = DhtReads()

    def is_live(self, status: PeerStatus) -> bool:
        return True

    def stage_peers(self, stage: int) -> list[PeerStatus]:
        return [s for s in self.peers.values() if s.stage == stage]


def test_a_holder_looks_like_it_dropped_the_gradient_only_on_an_info_asked_after_its_answer():
    mb = Microbatch("t0/3/0", [0, 1], torch.zeros(2, 4), torch.zeros(2, 4), 3, 0)
    status = PeerStatus(load=PeerLoad("p", 2, "127.0.0.1:1"), record_state=PeerState.ONLINE)
    status.epoch = 4  # an Info answered before the drop the answer below came after
    status.last_info_ok = status.info_asked = time.monotonic()
    rec = HeldBackward(mb, 2, "p", 5, 3, pb.BackwardRequest(), {})  # held under epoch 5
    replayer = Replayer(_View(status), None, None, "run", None, None)
    status.epoch, status.info_asked = 6, time.monotonic() + 1
    assert not replayer.lost(rec)  # answered a moment ago: not judged yet
    rec.answered -= 2.0
    status.epoch, status.info_asked = 4, rec.answered - 1
    assert not replayer.lost(rec)  # stale: no replay (one would put the gradient on two peers)
    status.info_asked = status.last_info_ok = time.monotonic() + 1  # asked after the answer: still 5
    status.epoch = 5
    assert not replayer.lost(rec)
    status.epoch = 6  # asked after the answer, and it dropped since: replay
    assert replayer.lost(rec)
    status.load.stage = 1  # moved away: lost whatever the epoch says
    status.epoch = 5
    assert replayer.lost(rec)


def test_a_holder_this_view_has_not_discovered_yet_gets_a_grace_period():
    mb = Microbatch("t0/3/0", [0, 1], torch.zeros(2, 4), torch.zeros(2, 4), 3, 0)
    status = PeerStatus(load=PeerLoad("p", 2, "127.0.0.1:1"), record_state=PeerState.ONLINE)
    view = _View(status)
    view.peers = {}  # the duplicate answer named "q", which this view does not know yet
    rec = HeldBackward(mb, 2, "q", 0, 3, pb.BackwardRequest(), {})
    replayer = Replayer(view, None, None, "run", None, None)
    rec.answered -= 2.0
    assert not replayer.lost(rec)
    assert view.dht_reads.asked == 1  # its view reads the DHT soon, not at its next period
    rec.answered -= 10.0
    assert replayer.lost(rec)  # still unknown long after: gone


def test_a_replay_goes_to_a_mate_of_a_live_holder_that_dropped_it():
    """The outlier rule leaves a peer out and it drops what it holds: replayed on the same peer,
    the same samples gave the same outlying norm again and again (a 75 s loop in one run)."""
    mb = Microbatch("t0/3/0", [0, 1], torch.zeros(2, 4), torch.zeros(2, 4), 3, 0)
    status = PeerStatus(load=PeerLoad("p", 2, "127.0.0.1:1"), record_state=PeerState.ONLINE)
    view = _View(status)
    rec = HeldBackward(mb, 2, "p", 5, 3, pb.BackwardRequest(), {})
    replayer = Replayer(view, None, None, "run", None, None)
    assert replayer._replay_exclude(rec) == set()  # the stage's only peer: it takes the replay
    view.peers["q"] = PeerStatus(load=PeerLoad("q", 2, "127.0.0.1:2"), record_state=PeerState.ONLINE)
    assert replayer._replay_exclude(rec) == {"p"}  # a mate takes it
    view.accused["q"] = object()
    assert replayer._replay_exclude(rec) == set()  # an accused mate takes no work
    view.accused = {"p": object()}
    assert replayer._replay_exclude(rec) == {"p"}


def test_the_end_of_training_waits_for_held_records_until_released_or_the_deadline(caplog):
    """At the end, a trainer stays while it holds records (a stage may rebuild its last update from
    their replays), until they are released, the deadline passes, or a stop is asked for."""
    import asyncio

    mb = Microbatch("t0/3/0", [0, 1], torch.zeros(2, 4), torch.zeros(2, 4), 3, 0)
    status = PeerStatus(load=PeerLoad("p", 2, "127.0.0.1:1"), record_state=PeerState.ONLINE)

    async def go() -> tuple[float, float, float]:
        replayer = Replayer(_View(status), None, None, "run", None, asyncio.Event())
        replayer.held = [HeldBackward(mb, 2, "p", 0, 3, pb.BackwardRequest(), {})]
        t0 = time.monotonic()
        await replayer.settle(0.3, asyncio.Event())  # nothing releases it: the deadline ends the wait
        timed_out = time.monotonic() - t0

        async def release() -> None:
            await asyncio.sleep(0.1)
            replayer.held = []
            replayer.progress.set()

        t0 = time.monotonic()
        await asyncio.gather(release(), replayer.settle(30.0, asyncio.Event()))
        released = time.monotonic() - t0
        replayer.held = [HeldBackward(mb, 2, "p", 0, 3, pb.BackwardRequest(), {})]
        stop = asyncio.Event()
        stop.set()
        t0 = time.monotonic()
        await replayer.settle(30.0, stop)
        return timed_out, released, time.monotonic() - t0

    with caplog.at_level("INFO"):
        timed_out, released, stopped = asyncio.run(go())
    assert 0.3 <= timed_out < 2.0 and released < 2.0 and stopped < 0.5
    warnings = [r for r in caplog.records if "training ends with 1 gradient record" in r.getMessage()]
    assert [r.levelno for r in warnings] == [logging.WARNING, logging.INFO]  # a stopped run: no surprise
