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


def test_refresh_now_publishes_at_once_and_refresh_soon_is_rate_limited():
    calls, publish, wait_for = _counting()
    announcer = Announcer(publish, period=30.0, ttl=60.0).start()
    try:
        assert wait_for(1)  # the first publish on start
        announcer.refresh_soon(min_gap_s=30.0)  # published a moment ago: left to the periodic refresh
        assert not wait_for(2, timeout=0.5)
        announcer.refresh_now()
        assert wait_for(2)
        announcer.last_publish -= 31.0  # as if the last store were long ago
        announcer.refresh_soon(min_gap_s=30.0)
        assert wait_for(3)
    finally:
        announcer.stop()
