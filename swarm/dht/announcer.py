"""Keeps a DHT record alive: re-published every `period` seconds with a TTL, in a background
thread (like Petals' announcer), and an explicit final record (e.g. "offline") on stop."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Announcer:
    """Refreshes a record in the background every `period` seconds (TTL = `ttl`), like Petals' announcer.

    `stop()` stores the final (offline) record once, explicitly, so that readers need not wait for
    the TTL to learn that the peer left.
    """

    def __init__(self, publish: Callable[[float], bool], period: float, ttl: float, name: str = "announcer") -> None:
        self.publish, self.period, self.ttl = publish, period, ttl
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.last_ok: float | None = None

    def start(self) -> Announcer:
        self._thread.start()
        return self

    def refresh_now(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self.publish(self.ttl):
                    self.last_ok = time.monotonic()
                else:
                    logger.warning("DHT store was rejected")
            except Exception as e:  # noqa: BLE001 - keep announcing through transient errors
                logger.warning("announce failed: %s", e)
            self._wake.wait(self.period)
            self._wake.clear()

    def stop(self, final: Callable[[], object] | None = None) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.period + 5)
        if final is not None:
            try:
                final()
            except Exception as e:  # noqa: BLE001
                logger.warning("final announce failed: %s", e)
