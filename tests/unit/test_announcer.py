"""The DHT announcer (swarm.dht.announcer): periodic refreshes, an immediate one on demand, and
frequent minor changes rate-limited."""

import threading
import time

from swarm.dht.announcer import Announcer


def _counting():
    calls: list[float] = []
    published = threading.Condition()

    def publish(ttl: float) -> bool:
        with published:
            calls.append(time.monotonic())
            published.notify_all()
        return True

    def wait_for(n: int, timeout: float = 10.0) -> bool:
        with published:
            return published.wait_for(lambda: len(calls) >= n, timeout)

    return calls, publish, wait_for


def test_refresh_now_publishes_at_once():
    calls, publish, wait_for = _counting()
    announcer = Announcer(publish, period=30.0, ttl=60.0).start()
    try:
        assert wait_for(1)  # the first publish on start
        assert not wait_for(2, timeout=0.5)  # the next periodic one is 30 s away
        announcer.refresh_now()
        assert wait_for(2)
    finally:
        announcer.stop()
