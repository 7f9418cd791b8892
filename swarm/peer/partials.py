"""Async look-ahead: stage-mates share their gradient sums for the pending update.

Each peer of a stage holds the gradients of the microbatches routed to it, so with two mates each
holds about half of what the stage knows about the pending update. The look-ahead
(swarm.peer.executor.lookahead) predicts that update from the gradients at hand, and a prediction from
a quarter of a batch costs far more than one from half (scripts/staleness_effect.py). So a peer
fetches a mate's sum (`GetPartialGradient`, bfloat16) whenever the mate's `Info` shows more samples
for the pending update than the peer last fetched from it, and predicts from all of them. The
update itself still comes from the stage's all-reduce (swarm.training.averaging): a partial sum only ever
moves a prediction, so a lost or late one costs accuracy of the look-ahead, nothing else.

Cost: per mate and change of its sum, one transfer of the stage's gradient in bfloat16 (half the
bytes the all-reduce moves) and one such copy in memory per mate until the update is applied.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import grpc
import torch

from swarm.cluster.view import PeerStatus
from swarm.core.checks import all_finite
from swarm.core.errors import RequestInvalid, StateError, SwarmError, WrongTarget
from swarm.core.states import PeerState
from swarm.peer.executor import Accumulated, StageExecutor
from swarm.wire.blob import blob_chunks, receive_blob
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb

logger = logging.getLogger(__name__)


FROZEN_WAIT_S = 3.0
FROZEN_POLL_S = 0.005
REDUCED_WAIT_S = 10.0  # longest a mate's request waits for this peer's reduced shard (its sums' fetches)
MAX_SHARDS = 1024


class PartialUnavailable(WrongTarget):
    """The requested update is not the one pending on this peer."""


_VIEWS = {"bfloat16": (torch.bfloat16, torch.int16, 2), "float32": (torch.float32, torch.float32, 4)}


def encode_partial(partial: Accumulated) -> tuple[dict, bytes]:
    """(header fields, raw little-endian bytes) of a flat sum from `partial_gradient` (bfloat16) or
    `frozen_gradient` (float32)."""
    if partial.samples == 0 or not partial.grads:
        return {"samples": 0, "dtype": "bfloat16"}, b""
    (flat,) = partial.grads
    dtype = "float32" if flat.dtype == torch.float32 else "bfloat16"
    return {"samples": partial.samples, "dtype": dtype}, flat.view(_VIEWS[dtype][1]).numpy().tobytes()


def decode_partial(
    header: dict, data: bytes | bytearray, params: list[torch.Tensor], step: int, dtype: str = "bfloat16"
) -> Accumulated:
    """Check and unpack a mate's sum: the step asked for, a sample count, one finite value of `dtype`
    per parameter (views of `data`, shaped as `params`). Raises StateError on anything else."""
    flat, samples = decode_flat(header, data, step, sum(p.numel() for p in params), dtype)
    if flat is None:
        return Accumulated(None, 0, step)
    return Accumulated(
        [g.view(p.shape) for g, p in zip(flat.split([p.numel() for p in params]), params, strict=True)], samples, step
    )


def decode_flat(
    header: dict, data: bytes | bytearray, step: int, numel: int, dtype: str = "float32", shard: list | None = None
) -> tuple[torch.Tensor | None, int]:
    """(a flat view of `data`, the sample count) of a mate's sum or shard of one: the step asked
    for, the shard asked for (`shard`: [index, count]), a sample count, `numel` finite values of
    `dtype` (None for a sum of no samples). Raises StateError on anything else."""
    if header.get("step") != step:
        raise StateError(f"partial gradient is for step {header.get('step')!r}, asked for {step}")
    if header.get("shard") != shard:
        raise StateError(f"partial gradient is shard {header.get('shard')!r}, asked for {shard}")
    samples = header.get("samples")
    if not isinstance(samples, int) or samples < 0:
        raise StateError(f"partial gradient sample count {samples!r} is not a non-negative int")
    if samples == 0:
        return None, 0
    if header.get("dtype") != dtype:
        raise StateError(f"partial gradient dtype {header.get('dtype')!r}, want {dtype}")
    torch_dtype, raw_dtype, size = _VIEWS[dtype]
    if len(data) != size * numel:
        raise StateError(f"partial gradient holds {len(data)} bytes, the stage needs {size * numel}")
    flat = torch.frombuffer(data, dtype=raw_dtype).view(torch_dtype) if numel else torch.zeros(0, dtype=torch_dtype)
    if not all_finite(flat):
        raise StateError("partial gradient holds NaN or infinite values")
    return flat, samples


def requested_shard(request: pb.PartialRequest) -> tuple[int, int] | None:
    """(index, count) of the shard a request asks for, None for a whole sum; RequestInvalid when
    it is no shard of a stage (count 0 with an index, an index out of range, absurd counts)."""
    index, count = int(request.shard_index), int(request.shard_count)
    if count == 0 and index == 0 and not request.reduced:
        return None
    if not 1 <= count <= MAX_SHARDS or not 0 <= index < count:
        raise RequestInvalid(f"shard {index} of {count} is no shard of a stage (1 to {MAX_SHARDS} shards)")
    return index, count


async def reduced_chunks(
    executor: StageExecutor, request: pb.PartialRequest, shard: tuple[int, int]
) -> AsyncIterator[bytes]:
    """This peer's shard (`shard`: index, count) of the stage-wide frozen sum of update
    `request.step`, reduced over the agreement `request.agreement` (swarm.peer.direct); waits up to
    REDUCED_WAIT_S for it to be reduced here (a mate that finished its own shard first asks before
    this one is done)."""
    index, count = shard
    step, deadline = int(request.step), time.monotonic() + REDUCED_WAIT_S
    while True:
        held = executor.reduced_shard
        if held is not None and (held.step, held.agreement) == (step, request.agreement):
            break
        if time.monotonic() >= deadline:
            raise PartialUnavailable(f"no shard of update {step} reduced here over that agreement")
        await asyncio.sleep(FROZEN_POLL_S)
    if (held.index, held.count) != (index, count):
        raise PartialUnavailable(f"this peer reduced shard {held.index} of {held.count}, not {index} of {count}")
    data = held.values.numpy().tobytes()
    meta = {"samples": held.samples, "dtype": "float32", "shard": [index, count]}
    async for chunk in blob_chunks(data, checksum=False, step=step, **meta):
        yield chunk


async def partial_chunks(
    executor: StageExecutor, request: pb.PartialRequest, before_fetch: Callable[..., Awaitable[None]] | None = None
) -> AsyncIterator[bytes]:
    """What GetPartialGradient streams: this peer's own sum for `step`, taken between batches; with
    `frozen`, its frozen float32 sum (or one shard of it) for the stage's direct averaging (with its
    accumulator epoch); with `reduced`, its reduced shard (`reduced_chunks`). No checksum (TCP
    checks what it carries; a sum corrupted anyway would make the mates' parameters differ, which
    their fingerprints catch: swarm.peer.stepping, "diverged")."""
    step, frozen, shard = int(request.step), request.frozen, requested_shard(request)
    if request.reduced:
        async for chunk in reduced_chunks(executor, request, shard):
            yield chunk
        return
    if frozen:
        if before_fetch is not None:  # debug only: a fault injected here (swarm.peer.faults)
            await before_fetch(executor, step)
        # a mate that agreed a moment before this peer reached its own averaging waits for it, up to
        # FROZEN_WAIT_S, while this peer holds that update frozen (as in an all-reduce, every member
        # takes part: a sum is handed out only while its owner averages it too, or after)
        # (read here without a hand-off to the compute thread; `frozen_gradient` decides)
        acc, began = executor.acc, time.monotonic()
        deadline = began + FROZEN_WAIT_S
        while (
            executor.averaging_step != step
            and acc.frozen is not None
            and acc.frozen.step == step
            and time.monotonic() < deadline
        ):
            await asyncio.sleep(FROZEN_POLL_S)
        # on a pool thread, under the accumulators' lock: no wait for the compute thread's batches,
        # and the event loop is not held by the copy of a large stage's gradient
        found = await asyncio.to_thread(executor.frozen_gradient, step, shard)
        if found is None:
            raise PartialUnavailable(f"update {step} is not frozen here (this peer is at step {executor.step})")
        partial, epoch = found
        fields, data = encode_partial(partial)
        if shard is not None:
            fields["shard"] = list(shard)
        waited_ms = round(1000 * (time.monotonic() - began), 1)  # for the asker's timeline: a straggler
        async for chunk in blob_chunks(data, checksum=False, step=step, epoch=epoch, waited_ms=waited_ms, **fields):
            yield chunk
        return
    if shard is not None:
        raise RequestInvalid("a look-ahead sum is never sharded (shards are of frozen sums)")
    partial = await asyncio.wrap_future(executor.call(lambda: executor.partial_gradient(step)))
    if partial is None:
        raise PartialUnavailable(f"step {step} is not pending here (this peer is at step {executor.step})")
    fields, data = encode_partial(partial)
    async for chunk in blob_chunks(data, checksum=False, step=step, **fields):
        yield chunk


class MateSource(Protocol):
    """What the fetcher needs of the peer (its membership: swarm.peer.membership)."""

    @property
    def executor(self) -> StageExecutor | None: ...

    @property
    def stage(self) -> int: ...

    def live_mates(self) -> list[PeerStatus]: ...


class MatePartials:
    """Keeps the executor supplied with its live mates' latest sums for the pending update."""

    def __init__(
        self,
        peer: MateSource,
        clients: ClientPool,
        run_id: str,
        interval_s: float = 0.5,
        timeout_s: float = 5.0,
        max_bytes: int = 1 << 30,
    ) -> None:
        self.peer, self.clients, self.run_id = peer, clients, run_id
        self.interval_s, self.timeout_s, self.max_bytes = interval_s, timeout_s, max_bytes
        self.fetched: dict[str, tuple[int, int]] = {}  # peer id -> (step, samples) last installed
        self.fetches = 0
        self.failures = 0
        self._in_flight: set[str] = set()
        self._backoff: dict[str, tuple[float, float]] = {}  # peer id -> (retry after, delay)
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        """Poll now and then (the peer also calls `poll` after each round of Info polls), and
        cancel the fetches in flight when cancelled."""
        try:
            while True:
                await asyncio.sleep(self.interval_s)
                self.poll()
        finally:
            for task in list(self._tasks):
                task.cancel()

    def poll(self) -> None:
        """Start a fetch from each mate at our pending step that holds more samples than we have."""
        ex = self.peer.executor
        if ex is None or not ex.predict_params:
            return
        now = time.monotonic()
        for mate in self.peer.live_mates():
            pid = mate.peer_id
            if pid in self._in_flight or mate.record_state != PeerState.ONLINE or mate.step != ex.step:
                continue
            if now < self._backoff.get(pid, (0.0, 0.0))[0]:
                continue
            step, samples = self.fetched.get(pid, (-1, 0))
            if mate.samples_accumulated <= (samples if step == ex.step else 0):
                continue
            self._in_flight.add(pid)
            task = asyncio.create_task(self._fetch(mate, ex, ex.step))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _fetch(self, mate: PeerStatus, ex: StageExecutor, step: int) -> None:
        pid = mate.peer_id
        try:
            request = pb.PartialRequest(run_id=self.run_id, stage=self.peer.stage, step=step)
            stream = self.clients.get(mate.load.address).get_partial_gradient(request, timeout=self.timeout_s)
            header, data = await receive_blob(stream, self.max_bytes, "partial gradient")
            partial = decode_partial(header, data, ex.params, step)
            if ex is not self.peer.executor:
                return  # this peer moved to another stage meanwhile
            if await asyncio.wrap_future(ex.call(lambda: ex.set_mate_partial(pid, partial))):
                self.fetched[pid] = (step, partial.samples)
                self.fetches += 1
            self._backoff.pop(pid, None)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:  # else the mate merely moved on a step
                self._failed(pid, f"{e.code().name}: {(e.details() or '')[:120]}")
        except (SwarmError, ValueError) as e:  # a bad sum (StateError), or this executor stopped
            self._failed(pid, str(e))
        finally:
            self._in_flight.discard(pid)

    def _failed(self, pid: str, why: str) -> None:
        self.failures += 1
        delay = min(30.0, 2 * self._backoff.get(pid, (0.0, 0.5))[1])
        self._backoff[pid] = (time.monotonic() + delay, delay)
        logger.warning("partial gradient from mate %s refused (%s); next try in %.0f s", pid[-6:], why, delay)
