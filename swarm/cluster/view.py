"""A process's live view of the swarm: who serves which stage, how fast, at which step.

Two sources, merged: the DHT stage records (discovery, re-read every couple of seconds while they
change, less often while they do not: swarm.cluster.dht_reads) and direct
`Info` polls of each known peer over gRPC (fresh step, queue and accumulator state, and liveness:
a peer that stops answering is dropped from wiring within `dead_after` seconds, before its DHT
record expires).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from swarm.cluster.accusations import MAX_HINT_IDS, AccusationReads
from swarm.cluster.dht_reads import DhtReads, signature
from swarm.cluster.fallbacks import fallbacks_of
from swarm.cluster.watch import MateWatch
from swarm.core.settings import DHT_REFRESH_S, INFO_PERIOD_S, INFO_TIMEOUT_S, LIVENESS_WINDOW_S
from swarm.core.states import PeerState
from swarm.dht.node import SwarmDHT
from swarm.dht.records import Accusation, AccusationRecord, PeerEntry
from swarm.policy.polling import DHT_ENTRY_BYTES, dht_period
from swarm.policy.wiring import PeerLoad
from swarm.wire.pool import ClientPool

logger = logging.getLogger(__name__)


@dataclass
class PeerStatus:
    load: PeerLoad
    record_state: PeerState = PeerState.JOINING
    record_expiration: float = 0.0
    step: int = 0
    accumulating_step: int = 0
    samples_accumulated: int = 0
    last_info_ok: float = 0.0
    info_asked: float = 0.0  # when the Info request behind the fields below was sent (monotonic)
    first_seen: float = field(default_factory=time.monotonic)
    info_failures: int = 0
    refused: bool = False  # its last Info poll found nothing listening (UNAVAILABLE): dead, not slow
    fingerprint: tuple[float, float] = (0.0, 0.0)
    epoch: int = 0  # accumulator epoch: gradients it held under an older one are gone
    note: str = ""  # why it is not serving yet, as it says
    device: str = ""  # from its DHT record
    uptime_s: float = 0.0
    samples_processed: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # what its stage did off the normal path
    poll_period_s: float = INFO_PERIOD_S  # how often it asks to be polled (swarm.policy.polling)
    next_poll: float = 0.0  # when the view's loop polls it next

    @property
    def peer_id(self) -> str:
        return self.load.peer_id

    @property
    def stage(self) -> int:
        return self.load.stage


def _state_of(text: str) -> PeerState:
    """A state a peer reports in Info; an unknown one (a newer peer) counts as not serving."""
    try:
        return PeerState(text)
    except ValueError:
        return PeerState.OFFLINE


class SwarmView:
    def __init__(
        self,
        dht: SwarmDHT,
        num_stages: int,
        clients: ClientPool,
        dht_period_s: float = DHT_REFRESH_S,
        info_period_s: float = INFO_PERIOD_S,
        info_timeout_s: float = INFO_TIMEOUT_S,
        exclude_peer: str | None = None,
    ) -> None:
        self.dht, self.num_stages, self.clients = dht, num_stages, clients
        self.dht_period_s, self.info_period_s, self.info_timeout_s = dht_period_s, info_period_s, info_timeout_s
        self.exclude_peer = exclude_peer
        self.peers: dict[str, PeerStatus] = {}
        self.changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.hinted_reads: AccusationReads | None = None  # see start()
        self.dht_ok = False
        self.offline_seen: set[str] = set()
        self._dht_call: asyncio.Future | None = None
        self.dht_reads = DhtReads()  # when the next DHT read is due, or asked for
        self.poll_stages: set[int] | None = None
        self.watched: set[str] = set()  # peers a MateWatch keeps fresh: the periodic polls skip them
        self.watch: MateWatch | None = None
        # called after each round of Info polls (e.g. swarm.peer.partials reacts to a mate's new count)
        self.info_listeners: list[Callable[[], None]] = []
        # peers a trainer caught answering differently from their stage-mates (swarm.trainer.honesty):
        # they get no work and take no part in their stage's updates; the accusation, by peer id
        self.accused: dict[str, Accusation] = {}

    # ---- queries ----

    def is_live(self, status: PeerStatus, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if not status.record_state.serving or status.refused:
            return False  # refused: a killed peer is dropped at once, not after the window (a stopped one is not)
        if status.last_info_ok:
            # a peer polled less often (it has many pollers) gets as many polls' time to answer
            return now - status.last_info_ok < max(LIVENESS_WINDOW_S, 3 * status.poll_period_s)
        # never reached yet: optimistic until the first poll fails
        return status.info_failures == 0 and now - status.first_seen < LIVENESS_WINDOW_S + self.info_timeout_s

    def stage_peers(self, stage: int, live_only: bool = True) -> list[PeerStatus]:
        now = time.monotonic()
        return [s for s in self.peers.values() if s.stage == stage and (not live_only or self.is_live(s, now))]

    def stage_loads(self, stage: int, min_step: int | None = None) -> list[PeerLoad]:
        """Peers a trainer may send work to: live and online (not draining). With `min_step`, only
        those known to have applied step min_step - 1, if there are any (exact mode: a stage-mate
        applies the same update a moment later; the others would make the request wait)."""
        peers = [s for s in self.stage_peers(stage) if s.peer_id not in self.accused]
        if min_step is not None:
            ready = [s for s in peers if s.last_info_ok and s.step >= min_step]
            peers = ready or peers
        out = []
        for s in peers:
            s.load.online = s.record_state == PeerState.ONLINE
            out.append(s.load)
        return out

    def stage_step(self, stage: int) -> int | None:
        """The stage's step: the most advanced live peer's (stage-mates catch up to it). Only peers
        whose Info has answered count: a peer just seen in the DHT has not told its step yet."""
        peers = [p for p in self.stage_peers(stage) if p.last_info_ok]
        return max((p.step for p in peers), default=None)

    def global_step(self) -> int | None:
        """Steps applied by every stage: the minimum over stages (None while a stage has no live peer)."""
        steps = [self.stage_step(k) for k in range(self.num_stages)]
        return None if any(s is None for s in steps) else min(steps)

    def missing_stages(self) -> list[int]:
        return [k for k in range(self.num_stages) if not self.stage_peers(k)]

    # ---- refresh ----

    def apply_records(self, records: dict[int, list[PeerEntry]]) -> None:
        seen = set()
        for stage, entries in records.items():
            for entry in entries:
                rec = entry.record
                if rec.peer_id == self.exclude_peer:
                    continue
                if rec.state == PeerState.OFFLINE:
                    self.offline_seen.add(rec.peer_id)
                    if rec.peer_id in self.peers and self.peers[rec.peer_id].stage == stage:
                        self.peers[rec.peer_id].record_state = PeerState.OFFLINE
                    continue
                seen.add(rec.peer_id)
                status = self.peers.get(rec.peer_id)
                if status is None or status.stage != stage or status.load.address != rec.address:
                    old = status
                    status = PeerStatus(PeerLoad(rec.peer_id, stage, rec.address, throughput=max(rec.throughput, 1e-3)))
                    if old is not None:  # moved or re-addressed: keep the ban history
                        status.load.banned_until = old.load.banned_until
                        status.load.total_failures = old.load.total_failures
                    self.peers[rec.peer_id] = status
                status.record_state = PeerState(rec.state)
                status.device = rec.device
                status.record_expiration = entry.expiration
                if rec.throughput > 0:
                    status.load.throughput = rec.throughput
        for peer_id in list(self.peers):
            if peer_id not in seen and self.peers[peer_id].record_state != PeerState.OFFLINE:
                # its record expired or it went offline: keep it a little for bookkeeping, not for wiring
                self.peers[peer_id].record_state = PeerState.OFFLINE

    def _read_dht(self) -> tuple[dict[int, list[PeerEntry]], list[AccusationRecord]]:
        return self.dht.read_view(self.num_stages)

    async def refresh_dht(self) -> None:
        loop = asyncio.get_running_loop()
        # shielded: a cancelled refresh still finishes its (deadline-bound) DHT call before the DHT
        # can be shut down, so no thread is left waiting on a dead DHT process
        self.dht_reads.begin()
        self._dht_call = loop.run_in_executor(None, self._read_dht)
        records, accusations = await asyncio.shield(self._dht_call)
        self.dht_reads.after(signature(records, accusations))
        self.apply_records(records)
        self.apply_accusations(accusations)
        self.dht_ok = True
        self.changed.set()

    async def refresh_accusations(self) -> None:
        """Read the accusations now (before a stage agrees on an update: a peer accused a moment ago
        takes no part in it)."""
        loop = asyncio.get_running_loop()
        self.apply_accusations(await loop.run_in_executor(None, self.dht.get_accusations))

    def apply_accusations(self, records: list[AccusationRecord]) -> None:
        for record in records:
            for accusation in record.accusations:
                if accusation.accused not in self.accused:
                    logger.warning(
                        "trainer %s accuses peer %s of stage %d: its %s answer differs from its mates' by %.3g",
                        record.trainer_id, accusation.accused[-6:], accusation.stage, accusation.kind,
                        accusation.error,
                    )  # fmt: skip
                    self.accused[accusation.accused] = accusation

    def accused_hint(self) -> list[str]:
        """The newest accused peers this view knows, for Info polls and answers (swarm.cluster.accusations)."""
        return list(self.accused)[-MAX_HINT_IDS:] if self.accused else []

    async def poll_one(
        self, status: PeerStatus, wait_for_step: int = 0, wait_s: float = 0.0, watch: bool = False
    ) -> bool:
        """Poll one peer's Info (a long poll with `wait_for_step`, or with `watch`: until its step or
        accumulated samples differ from what this view last heard, swarm.cluster.watch); True if it
        answered."""
        status.next_poll = time.monotonic() + self.info_period_s  # after a failure: try again at the base rate
        asked = time.monotonic()
        # a watch's first poll is answered at once: there is nothing seen to compare with yet
        seen = (status.step, status.samples_accumulated) if watch and status.last_info_ok else None
        wait_s = wait_s if seen is not None or wait_for_step else 0.0
        try:
            client = self.clients.get(status.load.address)
            info = await client.info(
                timeout=self.info_timeout_s, wait_for_step=wait_for_step, wait_s=wait_s, accused=self.accused_hint(),
                seen=seen,
            )  # fmt: skip
        except grpc.aio.AioRpcError as e:
            status.info_failures += 1
            status.refused = e.code() == grpc.StatusCode.UNAVAILABLE
            return False
        except Exception as e:  # noqa: BLE001
            logger.debug("info poll of %s failed: %s", status.load.address, e)
            status.info_failures += 1
            return False
        if info.peer_id and info.peer_id != status.peer_id:
            status.info_failures += 1  # a different process now listens at that address
            return False
        status.info_failures, status.refused = 0, False
        client.set_lane(info.lane_port)
        status.last_info_ok, status.info_asked = time.monotonic(), asked
        if info.poll_period_ms > 0:
            status.poll_period_s = max(self.info_period_s, info.poll_period_ms / 1000)
        status.next_poll = status.last_info_ok + status.poll_period_s
        status.step = int(info.step)
        status.accumulating_step = int(info.accumulating_step)
        status.samples_accumulated = int(info.samples_accumulated)
        status.fingerprint = (info.params_sum, info.params_abs)
        status.epoch = int(info.epoch)
        status.uptime_s = info.uptime_ms / 1000.0
        status.samples_processed = int(info.samples_processed)
        status.note = info.note
        if info.accused and self.hinted_reads is not None:
            self.hinted_reads.hint(info.accused)
        status.fallbacks = fallbacks_of(info.fallbacks)
        status.load.reported_queue = float(info.queue_length)
        # Info is fresher than the DHT record; a peer that moved waits for its new record (read soon)
        status.record_state = _state_of(info.state) if info.stage == status.stage else PeerState.OFFLINE
        if info.stage != status.stage:
            self.dht_reads.want()
        if info.throughput > 0:
            status.load.throughput = info.throughput
        return True

    async def poll_info(
        self, stages: set[int] | None = None, concurrency: int | None = None, due_only: bool = False
    ) -> None:
        """Poll the Info of every known peer (of `stages`), at most `concurrency` at a time; `due_only`:
        only those whose poll period (the one each asks for) has passed."""
        now = time.monotonic()
        targets = [
            s
            for s in self.peers.values()
            if s.record_state != PeerState.OFFLINE
            and (stages is None or s.stage in stages)
            and (not due_only or (s.next_poll <= now and s.peer_id not in self.watched))
        ]
        if targets and concurrency:
            limit = asyncio.Semaphore(concurrency)

            async def bounded(s: PeerStatus) -> None:
                async with limit:
                    await self.poll_one(s)

            await asyncio.gather(*(bounded(s) for s in targets))
        elif targets:
            await asyncio.gather(*(self.poll_one(s) for s in targets))
        self.notify_answers()

    async def some_peer_past(self, step: int, stages: set[int], limit: int) -> bool:
        """Whether one of up to `limit` online peers of `stages` (a random pick) answers with a step past `step`."""
        online = [s for s in self.peers.values() if s.stage in stages and s.record_state == PeerState.ONLINE]
        sample = random.sample(online, min(len(online), limit))
        answered = await asyncio.gather(*(self.poll_one(s) for s in sample))
        return any(ok and s.step > step for ok, s in zip(answered, sample, strict=True))

    def notify_answers(self) -> None:
        """Info answers came in (a round of polls, or a watched mate's): wake the waiters and listeners."""
        self.changed.set()
        for listener in self.info_listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener must not stop the view
                logger.exception("info listener failed")

    async def wait_for_step(self, step: int, wait_s: float) -> bool:
        """Until the global step reaches `step`, at most about `wait_s`: the live, online peers still
        below it answer an Info long poll the moment they apply the update (what a trainer held back by
        the pacing waits for, learnt at once instead of at the next poll). False when it did not wait:
        no known peer is below `step`, or none answered (a cut link: the caller's own wait paces it)."""
        now = time.monotonic()
        online = [s for s in self.peers.values() if s.record_state == PeerState.ONLINE and self.is_live(s, now)]
        behind = [s for s in online if s.step < step]
        before = [s.last_info_ok for s in behind]
        pending = {asyncio.ensure_future(self.poll_one(s, step, wait_s)) for s in behind}
        reached = None
        try:
            while pending:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                reached = self.global_step()
                if reached is not None and reached >= step:
                    break
        finally:
            for task in pending:
                task.cancel()
            self.changed.set()
        answered = any(s.last_info_ok > t for s, t in zip(behind, before, strict=True))
        return answered or (reached is not None and reached >= step)

    async def _dht_loop(self) -> None:
        while True:
            try:
                await self.refresh_dht()
            except Exception as e:  # noqa: BLE001 - keep the view alive through DHT hiccups
                logger.warning("DHT refresh failed: %s", e)
                self.dht_reads.failed()
            # every process re-reads every stage record: stretched as the swarm grows, so that a record's
            # replicas serve a bounded number of reads (readers: the peers known; trainers are few)
            known = len(self.peers)
            record_bytes = known / max(1, self.num_stages) * DHT_ENTRY_BYTES
            await self.dht_reads.wait(dht_period(known, record_bytes, self.dht_period_s))

    async def _info_loop(self) -> None:
        while True:
            await self.poll_info(self.poll_stages, due_only=True)
            await asyncio.sleep(self.info_period_s)

    def start(
        self, poll_stages: set[int] | None = None, read_hinted_accusations: bool = False, watch: bool = False
    ) -> None:
        """Refresh the DHT records of all stages; poll Info of the peers of `poll_stages` (all if None;
        a peer that moves changes `poll_stages`), or with `watch` (a peer's mates) hold a long poll on
        each, answered when its accumulator changes (swarm.cluster.watch); with `read_hinted_accusations`,
        read the accusations as soon as an Info answer names an accused peer this view does not know
        (a trainer stops sending a liar work once it reads the accusation; swarm.cluster.accusations)."""
        self.poll_stages = poll_stages
        if read_hinted_accusations:
            self.hinted_reads = AccusationReads(self.refresh_accusations, lambda: set(self.peers) - set(self.accused))
        self._tasks = [asyncio.create_task(self._dht_loop()), asyncio.create_task(self._info_loop())]
        if watch:
            self.watch = MateWatch(self, self.notify_answers)
            self._tasks.append(asyncio.create_task(self.watch.run()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        if self._dht_call is not None:
            try:
                async with asyncio.timeout(self.dht.timeout + 1):
                    await asyncio.shield(self._dht_call)
            except Exception:  # noqa: BLE001
                pass

    async def wait_changed(self, timeout: float) -> None:
        """Until the view changes (at most `timeout`); the caller misses a peer: the DHT is read soon."""
        self.changed.clear()
        self.dht_reads.want()
        try:
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a cancellation that
            # arrives as the wait ends, and a cancelled microbatch task would then go on
            async with asyncio.timeout(timeout):
                await self.changed.wait()
        except TimeoutError:
            pass
