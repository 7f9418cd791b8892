"""What a peer tells the swarm through the DHT: its record under its stage's key (state, address,
throughput, queue, step), kept alive by a background announcer and ended by an explicit offline
record, and its recent events (join, move with reason, leave) for `swarm status` and dashboards."""

from __future__ import annotations

import collections
import json
import logging
import threading
import time

from swarm.core.states import PeerState
from swarm.core.version import __version__
from swarm.dht.announcer import Announcer
from swarm.dht.node import SwarmDHT
from swarm.dht.records import PeerRecord
from swarm.peer.serving import ServingState

logger = logging.getLogger(__name__)

MAX_EVENTS = 16  # the DHT record keeps this many recent events per peer
MAX_EVENT_CHARS = 400


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
    """This peer's recent events: logged, and published on the DHT (best effort, off the caller's
    thread) for `swarm status` and the dashboard."""

    def __init__(self, dht: SwarmDHT, ttl_s: float) -> None:
        self.dht, self.ttl_s = dht, ttl_s
        self.events: collections.deque[str] = collections.deque(maxlen=MAX_EVENTS)

    def add(self, kind: str, publish: bool = True, **fields: object) -> None:
        record = {"time": round(time.time(), 3), "event": kind, "peer": self.dht.peer_id[-12:], **fields}
        text = json.dumps(record, separators=(",", ":"))[:MAX_EVENT_CHARS]
        self.events.append(text)
        logger.info("event %s", text)
        if publish:
            threading.Thread(target=self.publish, daemon=True).start()

    def publish(self) -> None:
        try:
            self.dht.publish_events(list(self.events), self.ttl_s)
        except Exception as e:  # noqa: BLE001 - events are best effort
            logger.debug("publishing events failed: %s", e)
