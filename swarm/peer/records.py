"""What a peer tells the swarm through the DHT: its record under its stage's key (state, address,
throughput, queue, step), kept alive by a background announcer and ended by an explicit offline
record, and its recent events (join, move with reason, leave) for `swarm status` and dashboards."""

from __future__ import annotations

import collections
import itertools
import json
import logging
import threading
import time

from swarm.core.states import PeerState
from swarm.core.version import __version__
from swarm.dht.announcer import Announcer
from swarm.dht.node import SwarmDHT
from swarm.dht.records import MAX_EVENTS_PER_PEER, ROUTINE_EVENTS, PeerRecord
from swarm.peer.serving import ServingState

logger = logging.getLogger(__name__)

ROUTINE_KEPT = 4  # routine events (checkpoints) the record keeps, of its MAX_EVENTS_PER_PEER
MAX_EVENT_CHARS = 400
RETRY_S = 2.0  # a failed store of the events is tried again after this long


class PeerRecords:
    """Builds and publishes this peer's stage record."""

    def __init__(self, dht: SwarmDHT, serving: ServingState, device: str, period_s: float, ttl_s: float) -> None:
        self.dht, self.serving, self.device = dht, serving, device
        self.period_s, self.ttl_s = period_s, ttl_s
        self.address = ""
        self.announcer: Announcer | None = None

    def record(self, state: PeerState | None = None) -> PeerRecord:
        s, ex = self.serving, self.serving.executor
        return PeerRecord(
            peer_id=self.dht.peer_id,
            state=state or s.state,
            address=self.address,
            throughput=float(s.throughput),
            queue=0 if ex is None else ex.queue_length,
            step=0 if ex is None else ex.step,
            version=__version__,
            device=self.device,
        )

    def announce(self, stage: int, state: PeerState | None = None) -> bool:
        """Store the record for `stage` now (blocking, within the DHT deadline)."""
        return self.dht.announce_peer(stage, self.record(state), self.ttl_s)

    def start(self) -> None:
        """Refresh the record of the stage served now every `period_s`."""
        self.announcer = Announcer(
            lambda ttl: self.dht.announce_peer(self.serving.stage, self.record(), ttl),
            self.period_s,
            self.ttl_s,
            name="peer-announcer",
        ).start()

    def refresh_now(self) -> None:
        if self.announcer is not None:
            self.announcer.refresh_now()

    def stop(self) -> None:
        """Stop refreshing and store an explicit offline record, so readers need not wait for the TTL."""
        if self.announcer is not None:
            self.announcer.stop(final=lambda: self.announce(self.serving.stage, PeerState.OFFLINE))


class EventLog:
    """This peer's recent events: logged, and published on the DHT for `swarm status` and the
    dashboard. The record keeps the newest MAX_EVENTS_PER_PEER, of which at most ROUTINE_KEPT
    routine ones (checkpoints), so that a checkpoint every step never pushes a move out of it.

    Publishing is off the caller's thread: one worker stores the newest list, one store at a time
    (a stale list never lands after a newer one), and tries again while the DHT refuses or fails."""

    def __init__(self, dht: SwarmDHT, ttl_s: float, retry_s: float = RETRY_S) -> None:
        self.dht, self.ttl_s, self.retry_s = dht, ttl_s, retry_s
        # (sequence number, text): the order they were added in
        self._notable: collections.deque[tuple[int, str]] = collections.deque(maxlen=MAX_EVENTS_PER_PEER - ROUTINE_KEPT)
        self._routine: collections.deque[tuple[int, str]] = collections.deque(maxlen=ROUTINE_KEPT)
        self._added = itertools.count()
        self._items_lock = threading.Lock()  # the deques (added to on the event loop, read by the worker)
        self._store_lock = threading.Lock()  # one store at a time, of the list as it is then
        self._pending = threading.Event()
        self._closed = False
        self._worker: threading.Thread | None = None

    @property
    def events(self) -> list[str]:
        """The events the record holds, oldest first."""
        with self._items_lock:
            return [text for _, text in sorted([*self._notable, *self._routine])]

    def add(self, kind: str, publish: bool = True, **fields: object) -> None:
        now = round(time.time(), 3)
        record = {"time": now, "event": kind, "peer": self.dht.peer_id[-12:], **fields}
        text = json.dumps(record, separators=(",", ":"))[:MAX_EVENT_CHARS]
        with self._items_lock:
            (self._routine if kind in ROUTINE_EVENTS else self._notable).append((next(self._added), text))
        logger.info("event %s", text)
        if publish:
            self._wake()

    def publish(self) -> bool:
        """Store the record now (blocking, within the DHT deadline); on failure the worker tries again."""
        with self._store_lock:
            try:
                stored = self.dht.publish_events(self.events, self.ttl_s)
            except Exception as e:  # noqa: BLE001 - events are best effort, retried below
                logger.debug("publishing events failed: %s", e)
                stored = False
        if not stored:
            self._wake()
        return stored

    def close(self) -> None:
        """No more stores from the worker (the DHT is about to stop); `publish` still works."""
        self._closed = True
        self._pending.set()

    def _wake(self) -> None:
        self._pending.set()
        with self._items_lock:  # added to from the event loop and from the checkpoint writer's thread
            if self._worker is None and not self._closed:
                self._worker = threading.Thread(target=self._run, name="peer-events", daemon=True)
                self._worker.start()

    def _run(self) -> None:
        while True:
            self._pending.wait()
            self._pending.clear()
            if self._closed:
                return
            if not self.publish():
                time.sleep(self.retry_s)
