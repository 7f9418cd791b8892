"""A peer's recent events (swarm.peer.records.EventLog) and the windows that show them
(swarm.dht.records.newest_events): routine events never push out the ones that matter."""

import json
import threading
import time

from swarm.dht.records import MAX_EVENTS_PER_PEER, newest_events
from swarm.peer.records import ROUTINE_KEPT, EventLog


class FakeDHT:
    peer_id = "12D3KooWpeerpeerpeer"

    def __init__(self, fail: int = 0) -> None:
        self.stored: list[list[str]] = []
        self.fail = fail  # the first `fail` stores are refused
        self.stored_once = threading.Event()

    def publish_events(self, events: list[str], ttl: float) -> bool:
        if self.fail > 0:
            self.fail -= 1
            return False
        self.stored.append(list(events))
        self.stored_once.set()
        return True


def kinds(texts: list[str]) -> list[str]:
    return [json.loads(t)["event"] for t in texts]


def test_checkpoints_every_step_never_push_a_move_out_of_the_record():
    log = EventLog(FakeDHT(), ttl_s=60)
    log.add("join", publish=False, stage=0)
    log.add("move", publish=False, src=0, dst=2)
    for step in range(100):
        log.add("checkpoint", publish=False, stage=2, step=step)
    events = log.events
    assert kinds(events) == ["join", "move"] + ["checkpoint"] * ROUTINE_KEPT
    assert [json.loads(t)["step"] for t in events[2:]] == [96, 97, 98, 99]  # the newest checkpoints
    times = [json.loads(t)["time"] for t in events]
    assert times == sorted(times)


def test_the_record_keeps_the_newest_notable_events_within_its_bound():
    log = EventLog(FakeDHT(), ttl_s=60)
    for i in range(40):
        log.add("move", publish=False, src=0, dst=1, n=i)
        log.add("checkpoint", publish=False, step=i)
    events = log.events
    assert len(events) == MAX_EVENTS_PER_PEER
    moves = [json.loads(t)["n"] for t in events if json.loads(t)["event"] == "move"]
    assert moves == list(range(40 - (MAX_EVENTS_PER_PEER - ROUTINE_KEPT), 40))


def test_a_refused_store_is_tried_again_until_it_lands():
    dht = FakeDHT(fail=2)
    log = EventLog(dht, ttl_s=60, retry_s=0.01)
    log.add("move", src=0, dst=1)
    assert dht.stored_once.wait(5)
    assert kinds(dht.stored[-1]) == ["move"]
    log.close()


def test_a_synchronous_publish_stores_the_newest_list():
    dht = FakeDHT()
    log = EventLog(dht, ttl_s=60)
    log.add("join", publish=False)
    log.add("move", publish=False, src=0, dst=1)
    assert log.publish()
    assert kinds(dht.stored[-1]) == ["join", "move"]
    assert log._worker is None  # nothing left to retry: no worker thread was needed


def test_a_burst_of_events_ends_with_the_newest_list_stored():
    dht = FakeDHT()
    log = EventLog(dht, ttl_s=60)
    for step in range(50):
        log.add("checkpoint", step=step)
    log.add("move", src=1, dst=0)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (dht.stored and "move" in kinds(dht.stored[-1])):
        time.sleep(0.01)
    assert kinds(dht.stored[-1])[-1] == "move"
    log.close()


def test_the_status_window_keeps_moves_before_checkpoints():
    events = [{"time": float(t), "event": "checkpoint", "step": t} for t in range(100)]
    events.insert(3, {"time": 2.5, "event": "move", "src": 0, "dst": 2})
    events.append({"time": 0.5, "event": "join"})
    window = newest_events(events, 10)
    assert [e["event"] for e in window] == ["join", "move"] + ["checkpoint"] * 8
    assert [e["step"] for e in window[2:]] == list(range(92, 100))
    assert newest_events(events, 10, routine_limit=0) == [events[-1], events[3]]
    assert newest_events(events, 1)[0]["event"] == "move"
    assert newest_events(events, 0) == []
