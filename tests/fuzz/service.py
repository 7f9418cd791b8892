"""A real `StageService` in process, for fuzzing its handlers: three stages of a tiny GPT, each with
its own `ServingState` and `StageExecutor` (stage 0 with the async look-ahead on, stage 1 in exact
mode with a short step wait, stage 2 the last stage, with targets), and a ledger of a few applied
updates for GetLedger to serve.

grpc.aio's servicer context cannot be built outside a server: `FakeContext.abort` raises `Aborted`
with the status code, as the real one raises after sending the status. Handlers are called directly
with the raw request bytes (unary, server-streamed) or an async iterator of raw chunks (bidi); the
lane's handler with the chunks as one frame's segments (its status as `Aborted`, its response chunk
as the trailing metadata a stream would carry).
"""

from __future__ import annotations

import asyncio
import functools
import resource
from dataclasses import dataclass

import grpc
import torch

from swarm.core.states import PeerState
from swarm.peer.executor import StageExecutor
from swarm.peer.lane import LaneService
from swarm.peer.server import StageService
from swarm.peer.serving import Limits, ServingState
from swarm.policy.ledger import Held, LedgerEntry
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.wire import codec, stream
from swarm.wire.lane import STREAMED
from swarm.wire.protocol import pb

SPEC = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 3, "n_heads": 2, "d_ff": 32}
STAGES = 3
RUN_ID = "fuzz-run"
LIMITS = Limits(max_message_bytes=1 << 20, max_numel=1 << 16, max_batch=16)
LEDGER_STEPS = 12  # applied updates in each stage's ledger
CALL_TIMEOUT_S = 10.0

UNARY = ("info", "forward", "backward", "get_contributions")
SERVER_STREAMED = ("get_state", "get_partial_gradient", "get_ledger")
BIDI = ("forward_stream", "backward_stream")
LANE = ("forward_lane", "backward_lane")  # the same chunks in one lane frame (swarm.peer.lane)
METHODS = UNARY + SERVER_STREAMED + BIDI + LANE
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}
ALLOWED_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.ABORTED,
    }
)


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class FakeContext:
    """What the handlers use of grpc.aio's servicer context."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:50000") -> None:
        self.trailing: dict | None = None
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = dict(metadata)


@dataclass
class Stage:
    service: StageService
    serving: ServingState
    executor: StageExecutor


class FuzzService:
    def __init__(self) -> None:
        if resource.getrlimit(resource.RLIMIT_AS)[0] == resource.RLIM_INFINITY:
            # a header that lies about its shape may make a handler allocate gigabytes: let it fail
            raise RuntimeError("fuzz the handlers under tests.fuzz.harness.address_space_limit()")
        torch.manual_seed(0)
        self.loop = asyncio.new_event_loop()
        self.stages = [self._stage(k) for k in range(STAGES)]
        self.calls = 0  # each call comes from another client address (per-client bounds apply)

    @staticmethod
    def _stage(k: int) -> Stage:
        built = build_stage(SPEC, k, STAGES)
        executor = StageExecutor(built, OptimConfig(), max_batch_samples=64, predict_params=k == 0)
        serving = ServingState(RUN_ID, f"fuzz-peer-{k}", "fuzz")
        serving.stage, serving.state, serving.executor, serving.schema = k, PeerState.ONLINE, executor, built.schema
        if k == 1:
            serving.exact, serving.step_wait_s = True, 0.05
        for step in range(LEDGER_STEPS):
            executor.ledger.record(LedgerEntry(k, step, {f"t0/{step}/0": Held(2, step)}, [("fuzz-peer", 0)], 1.0))
        return Stage(StageService(serving, LIMITS), serving, executor)

    def call(self, stage: int, method: str, payload) -> tuple[list[bytes], FakeContext]:
        """The handler's answer (its messages) and context; raises Aborted for an error status and
        TimeoutError past CALL_TIMEOUT_S."""
        self.calls += 1
        context = FakeContext(f"ipv4:127.0.{self.calls // 250 % 250}.{self.calls % 250}:{40000 + self.calls % 999}")
        coro = _invoke(self.stages[stage].service, method, payload, context)
        out = self.loop.run_until_complete(asyncio.wait_for(coro, CALL_TIMEOUT_S))
        return out, context

    def close(self) -> None:
        for stage in self.stages:
            stage.executor.stop()
        self.loop.close()

    # ---- health ----

    def valid_forward(self, k: int, batch: int = 2) -> pb.ForwardRequest:
        t, d = SPEC["seq_len"], SPEC["d_model"]
        x = torch.randint(0, SPEC["vocab_size"], (batch, t)) if k == 0 else torch.randn(batch, t, d)
        request = pb.ForwardRequest(request_id="probe", run_id=RUN_ID, stage=k, step=self.stages[k].executor.step)
        request.input.CopyFrom(codec.tensor_to_proto(x))
        if k == STAGES - 1:
            request.targets.CopyFrom(codec.tensor_to_proto(torch.randint(0, SPEC["vocab_size"], (batch, t))))
        return request

    def probe(self) -> None:
        """Every stage still answers a valid Forward, with the right output shape (raises if not)."""
        for k, stage in enumerate(self.stages):
            out, _ = self.call(k, "forward", self.valid_forward(k).SerializeToString())
            response = pb.ForwardResponse.FromString(out[0])
            if k < STAGES - 1:
                y = codec.decode(response.output)
                assert tuple(y.shape) == (2, SPEC["seq_len"], SPEC["d_model"]), f"stage {k} output {y.shape}"
            assert stage.serving.in_flight == 0, f"stage {k}: {stage.serving.in_flight} requests still in flight"


async def _invoke_lane(service: StageService, method: str, payload, context: FakeContext) -> list[bytes]:
    kind = method.split("_")[0]
    status, segments, _ = await LaneService(service).answer(kind, list(payload), STREAMED, context.peer())
    if status:
        raise Aborted(STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN), bytes(segments[0]).decode())
    head = pb.Chunk.FromString(bytes(segments[0]))
    context.trailing = {stream.RESPONSE_KEY: head.header, stream.PARTS_KEY: ",".join(map(str, head.parts))}
    return [bytes(s) for s in segments[1:]]


async def _invoke(service: StageService, method: str, payload, context: FakeContext) -> list[bytes]:
    if method in LANE:
        return await _invoke_lane(service, method, payload, context)
    handler = getattr(service, method)
    if method in UNARY:
        return [await handler(payload, context)]
    if method in SERVER_STREAMED:
        return [chunk async for chunk in handler(payload, context)]

    async def chunks():
        for chunk in payload:
            yield chunk

    return [chunk async for chunk in handler(chunks(), context)]


@functools.cache
def fuzz_service() -> FuzzService:
    return FuzzService()
