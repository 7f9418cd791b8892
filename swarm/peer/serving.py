"""What a peer's gRPC service serves right now: the stage, its executor and schema, the peer's
state, and the limits every request is checked against. The peer's membership swaps the stage's
parts when it moves; `info()` is the Info answer."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from swarm.core.errors import NotServing, WrongTarget
from swarm.core.states import PeerState
from swarm.peer.executor import StageExecutor
from swarm.training.models import StageSchema
from swarm.wire.options import MiB
from swarm.wire.protocol import pb

MAX_INFO_WAIT_S = 5.0  # the longest an Info long poll is held


@dataclass(frozen=True)
class Limits:
    """What a peer accepts (swarm.peer.admission enforces the per-client and per-kind bounds)."""

    max_message_bytes: int = 256 * MiB
    max_numel: int = 1 << 28
    max_batch: int = 256
    max_in_flight_per_client: int = 64  # Forward/Backward requests of one client connection at once
    max_in_flight: int = 1024  # ... of all clients
    max_streams: int = 256  # streamed requests open at once
    stream_read_timeout_s: float = 30.0  # a stream that sends nothing for this long is cut
    max_waiting: int = 64  # exact mode: requests held until this peer applies the step before theirs
    max_state_calls: int = 2  # GetState answered at once
    state_call_interval_s: float = 1.0  # per client host
    max_queue_tasks: int = 4096  # compute queue: tasks
    max_queue_bytes: int = 1 << 30  # ... and their input bytes
    max_steps_ahead: int = 2  # a request's step may be at most this far after the peer's


class ServingState:
    def __init__(self, run_id: str, peer_id: str, version: str) -> None:
        self.run_id, self.peer_id, self.version = run_id, peer_id, version
        self.stage: int = -1
        self.state: PeerState = PeerState.JOINING
        self.executor: StageExecutor | None = None
        self.schema: StageSchema | None = None
        self.codec: int = pb.CODEC_NONE
        self.started = time.monotonic()
        self.throughput: float = 0.0
        self.lane_port = 0  # Forward/Backward over plain TCP (swarm.wire.lane); 0: none
        self.in_flight = 0
        # exact mode: a request for step t is computed only once this peer has applied step t - 1
        self.exact = False
        self.step_wait_s = 20.0
        self.note = ""  # why this peer is not serving yet, for status and dashboards (e.g. no state)
        self.fallbacks: dict[str, int] = {}  # kind -> count of the fallbacks its stage took
        self.lie = None  # debug only (swarm.core.debug.LiePlan): a dishonest peer, for tests
        # the highest step this peer's live stage-mates report (its Info polls): a request too far
        # ahead of this peer but not of them finds this peer behind its stage, not the request wrong
        self.mates_step = 0
        # wakes the step decision: a backward accumulated here (the stage may now hold its batch)
        self.on_accumulated: Callable[[], None] | None = None
        # a mate asked what this peer holds for an update it has not frozen: it froze it, so the stage
        # may hold its batch; re-read the mates' counts now rather than at the next Info round
        self.on_mate_froze: Callable[[], None] | None = None
        # a training request for a step past this peer's came in (async: computed at predicted
        # parameters): the peer re-reads its mates' counts to fetch their partial sums now
        self.on_run_ahead: Callable[[], None] | None = None
        # an Info poller names peers accused of lying (InfoRequest.accused): swarm.cluster.accusations
        self.on_accused: Callable[[list[str]], object] | None = None
        self.accused_hint: Callable[[], list[str]] = list  # ... and those this peer knows, for its answers
        # debug only (swarm.core.debug.FaultPlan.in_request): awaited with the executor's step before a
        # training request is computed
        self.before_compute: Callable[[int], Awaitable[None]] | None = None
        # debug only (FaultPlan.in_mate_fetch): awaited with (executor, update) before a mate's fetch of a frozen sum
        self.before_mate_fetch: Callable[[StageExecutor, int], Awaitable[None]] | None = None
        # set (and replaced) whenever the step or the samples accumulated for it change
        self._changed: asyncio.Event | None = None

    def notify_step(self) -> None:
        """The executor's step changed (an update applied, a state loaded): answer the long polls."""
        self._notify()

    def notify_accumulated(self) -> None:
        """A backward was accumulated here: answer the mates' watches (swarm.cluster.watch), wake the
        step decision."""
        self._notify()
        if self.on_accumulated is not None:
            self.on_accumulated()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def accumulator_state(self) -> tuple[int, int]:
        """(step, samples accumulated for it), as Info reports them: what a mate's watch compares."""
        ex = self.executor
        return (0, 0) if ex is None else (ex.fingerprint[0], ex.samples_accumulated)

    async def wait_for_step(self, step: int, wait_s: float) -> None:
        """Until the executor's step reaches `step`, at most `wait_s` (an Info long poll)."""
        await self._wait_while(lambda: self.executor is None or self.executor.step < step, wait_s)

    async def wait_for_change(self, seen: tuple[int, int], wait_s: float) -> None:
        """Until this peer's (step, samples accumulated) differ from `seen`, at most `wait_s` (a mate's
        watch: it learns of each accumulated backward at once, not at its next poll)."""
        await self._wait_while(lambda: self.accumulator_state() == seen, wait_s)

    async def _wait_while(self, unchanged: Callable[[], bool], wait_s: float) -> None:
        deadline = time.monotonic() + min(wait_s, MAX_INFO_WAIT_S)
        while unchanged() and time.monotonic() < deadline:
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await self._changed.wait()
            except TimeoutError:
                return

    def check_target(self, run_id: str, stage: int) -> tuple[StageExecutor, StageSchema]:
        """The executor and schema to serve a request for (run_id, stage) with, or a typed error:
        WrongTarget (another run, or a stage this peer does not serve: it moved) or NotServing."""
        if run_id != self.run_id:
            raise WrongTarget(f"run id {run_id!r} is not this peer's run {self.run_id!r}")
        executor, schema = self.executor, self.schema
        if not self.state.serving or executor is None or schema is None:
            raise NotServing(f"peer is {self.state}, not serving")
        if stage != self.stage:
            raise WrongTarget(f"this peer serves stage {self.stage}, not stage {stage}")
        return executor, schema

    def info(self) -> pb.InfoResponse:
        ex = self.executor
        fp_step, fp_sum, fp_abs = (0, 0.0, 0.0) if ex is None else ex.fingerprint
        counters = None if ex is None else ex.counters
        return pb.InfoResponse(
            peer_id=self.peer_id,
            run_id=self.run_id,
            stage=self.stage,
            state=self.state.value,
            throughput=self.throughput,
            queue_length=0 if ex is None else ex.queue_length,
            version=self.version,
            step=fp_step,
            samples_accumulated=0 if ex is None else ex.samples_accumulated,
            accumulating_step=0 if ex is None else ex.accumulating_step,
            uptime_ms=int((time.monotonic() - self.started) * 1000),
            num_parameters=0 if ex is None else sum(p.numel() for p in ex.params),
            samples_processed=0 if counters is None else counters.samples_processed,
            samples_discarded=0 if counters is None else counters.samples_discarded,
            averaging_rounds=0 if counters is None else counters.averaging_rounds,
            params_sum=fp_sum,
            params_abs=fp_abs,
            compute_seconds=0.0 if counters is None else counters.compute_seconds,
            samples_predicted=0 if ex is None else ex.lookahead.counters.predicted_samples,
            epoch=0 if ex is None else ex.acc.epoch,
            ledger_steps=0 if ex is None else len(ex.ledger),
            fallbacks=json.dumps(self.fallbacks, separators=(",", ":")),
            note=self.note,
            lane_port=self.lane_port,
        )
