"""What a peer takes in, bounded before anything is allocated or queued: requests in flight per
client connection, streams open at once (each with a read deadline), exact-mode requests waiting
for a step, GetState calls (one snapshot per step, a few at a time, not too often per caller). A
request past a bound gets RESOURCE_EXHAUSTED marked retryable (`Overloaded`): the trainer tries again
later or elsewhere, nothing is dropped."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from swarm.core.errors import Overloaded
from swarm.peer.serving import Limits


class Admission:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.per_client: dict[str, int] = {}
        self.in_flight = 0
        self.streams = 0
        self.streams_peak = 0  # most streams open at once so far (Info reports it)
        self.waiting = 0
        self.state_calls = 0
        self._last_state_call: dict[str, float] = {}

    @contextlib.contextmanager
    def request(self, client: str) -> Iterator[None]:
        """One Forward/Backward from `client` (its connection, as gRPC names it)."""
        n = self.per_client.get(client, 0)
        if n >= self.limits.max_in_flight_per_client:
            raise Overloaded(f"{n} requests of this client are in flight here already; retry later")
        if self.in_flight >= self.limits.max_in_flight:
            raise Overloaded(f"{self.in_flight} requests are in flight here already; retry later")
        self.per_client[client] = n + 1
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]

    @contextlib.contextmanager
    def stream(self) -> Iterator[None]:
        if self.streams >= self.limits.max_streams:
            raise Overloaded(f"{self.streams} request streams are open here; retry later")
        self.streams += 1
        self.streams_peak = max(self.streams_peak, self.streams)
        try:
            yield
        finally:
            self.streams -= 1

    @contextlib.contextmanager
    def wait_for_step(self) -> Iterator[None]:
        """An exact-mode request held until this peer applies the step before it."""
        if self.waiting >= self.limits.max_waiting:
            raise Overloaded(f"{self.waiting} requests already wait for this peer's next step; retry later")
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    @contextlib.contextmanager
    def state_call(self, client: str) -> Iterator[None]:
        """A GetState: a few at a time, and not more often than every `state_call_interval_s` per
        client host."""
        host = client.rsplit(":", 1)[0]
        now = time.monotonic()
        if self.state_calls >= self.limits.max_state_calls:
            raise Overloaded("this peer is sending its state to others; retry in a moment")
        if now - self._last_state_call.get(host, -1e9) < self.limits.state_call_interval_s:
            raise Overloaded("state requested again too soon; retry in a moment")
        if len(self._last_state_call) > 4096:
            self._last_state_call.clear()
        self._last_state_call[host] = now
        self.state_calls += 1
        try:
            yield
        finally:
            self.state_calls -= 1
