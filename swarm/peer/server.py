"""The gRPC `Stage` service of a peer: decode, validate, hand to the executor, encode.

Handlers take raw bytes (no generated deserializer) so that a malformed message gets a clear
INVALID_ARGUMENT instead of a generic INTERNAL error. Every error goes back as a gRPC status; the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
import torch

from swarm.core.checks import all_finite
from swarm.peer.executor import NonFiniteError, StageExecutor
from swarm.training.models import StageSchema
from swarm.peer.partials import PartialUnavailable, partial_chunks
from swarm.wire import codec, messages
from swarm.wire.codec import MessageTooLarge, WireError
from swarm.wire.options import MiB, channel_options
from swarm.wire.protocol import pb
from swarm.wire.stream import PARTS_KEY, RESPONSE_KEY
from swarm.wire.tensors import split_samples

logger = logging.getLogger(__name__)

SERVICE = "swarm.Stage"


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 256 * MiB
    max_numel: int = 1 << 28
    max_batch: int = 256


class ServingState:
    """What the service serves right now; the peer swaps `executor`/`schema`/`stage` when it moves."""

    def __init__(self, run_id: str, peer_id: str, version: str) -> None:
        self.run_id, self.peer_id, self.version = run_id, peer_id, version
        self.stage: int = -1
        self.state: str = "joining"
        self.executor: StageExecutor | None = None
        self.schema: StageSchema | None = None
        self.codec: int = pb.CODEC_NONE
        self.started = time.monotonic()
        self.throughput: float = 0.0
        self.in_flight = 0
        self.state_provider: Callable[[], object] | None = None
        # exact mode: a request for step t is computed only once this peer has applied step t - 1
        self.exact = False
        self.step_wait_s = 20.0

    def info(self) -> pb.InfoResponse:
        ex = self.executor
        fp_step, fp_sum, fp_abs = (0, 0.0, 0.0) if ex is None else ex.fingerprint
        return pb.InfoResponse(
            peer_id=self.peer_id,
            run_id=self.run_id,
            stage=self.stage,
            state=self.state,
            throughput=self.throughput,
            queue_length=0 if ex is None else ex.queue_length,
            version=self.version,
            step=fp_step,
            samples_accumulated=0 if ex is None else ex.samples_accumulated,
            accumulating_step=0 if ex is None else ex.accumulating_step,
            uptime_ms=int((time.monotonic() - self.started) * 1000),
            num_parameters=0 if ex is None else sum(p.numel() for p in ex.params),
            samples_processed=0 if ex is None else ex.samples_processed,
            samples_discarded=0 if ex is None else ex.samples_discarded,
            averaging_rounds=0 if ex is None else ex.averaging_rounds,
            params_sum=fp_sum,
            params_abs=fp_abs,
            compute_seconds=0.0 if ex is None else ex.compute_seconds,
            samples_predicted=0 if ex is None else ex.predicted_samples,
        )


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


_HANDLED = (WireError, RequestError, NonFiniteError, ValueError, IndexError, TypeError, RuntimeError)


def _status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a request error maps to."""
    if isinstance(e, RequestError):
        return e.code, e.args[0]
    if isinstance(e, MessageTooLarge):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
    if isinstance(e, (WireError, NonFiniteError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, RuntimeError) and "shutting down" in str(e):
        return grpc.StatusCode.UNAVAILABLE, str(e)
    # torch raises RuntimeError on shape mismatches: the request's fault
    return grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}"


class StageService:
    def __init__(self, serving: ServingState, limits: Limits) -> None:
        self.serving = serving
        self.limits = limits

    # ---- validation ----

    def _check_target(self, msg) -> tuple[StageExecutor, StageSchema]:
        s = self.serving
        if msg.run_id != s.run_id:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, f"run id {msg.run_id!r} is not this peer's run {s.run_id!r}"
            )
        if s.state not in ("online", "draining") or s.executor is None or s.schema is None:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"peer is {s.state}, not serving")
        if msg.stage != s.stage:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION, f"this peer serves stage {s.stage}, not stage {msg.stage}"
            )
        return s.executor, s.schema

    def _targets(self, msg, schema: StageSchema, batch: int) -> torch.Tensor | None:
        if not schema.is_last:
            return None
        if not msg.HasField("targets"):
            raise WireError("the last stage needs targets")
        targets = codec.decode(msg.targets, self.limits.max_numel)
        schema.targets.check(targets, "targets", self.limits.max_batch)
        if targets.shape[0] != batch:
            raise WireError(f"targets batch {targets.shape[0]} differs from input batch {batch}")
        return targets

    def _check_header(self, header: pb.Tensor, what: str, schema: StageSchema) -> int:
        """Check a streamed tensor's header against the stage's schema before any part arrives."""
        if header.dtype not in codec.DTYPES or header.codec not in codec.CODEC_LABELS:
            raise WireError(f"{what}: unknown dtype {header.dtype!r} or codec {header.codec}")
        shape = tuple(int(d) for d in header.shape)
        if not shape or not 1 <= shape[0] <= self.limits.max_batch:
            raise WireError(f"{what} has shape {list(shape)}: batch must be in 1..{self.limits.max_batch}")
        if what == "input":
            schema.input.check(torch.zeros((1, *shape[1:]), dtype=codec.DTYPES[header.dtype]), what, 1)
        return shape[0]

    def _grad(self, grad: torch.Tensor | None, batch: int) -> torch.Tensor:
        if grad is None:
            raise WireError("backward on a non-last stage needs grad_output")
        if not grad.dtype.is_floating_point:
            raise WireError(f"grad_output must be a float tensor, got {grad.dtype}")
        if grad.shape[0] != batch:
            raise WireError(f"grad_output batch {grad.shape[0]} differs from input batch {batch}")
        if not all_finite(grad):
            raise WireError("grad_output contains NaN or infinity")
        return grad.float()

    # ---- computing: a request is one part (unary) or several (streamed) ----

    async def _compute(self, kind: str, msg, executor: StageExecutor, schema: StageSchema, targets, parts, acc: dict):
        """Run each (samples, input, grad_output) part as it comes; yield the encoded output parts.
        Per-request figures (loss, compute time, accumulated step) are collected in `acc`."""
        if msg.reply_codec not in codec.CODEC_LABELS:
            raise WireError(f"unknown reply codec {msg.reply_codec}")
        if self.serving.exact and not getattr(msg, "validation", False) and msg.step > executor.step:
            await self._wait_for_step(executor, int(msg.step))
        offset, index = 0, 0
        async for n, x, grad in parts:
            schema.input.check(x, "input", self.limits.max_batch)
            t = None if targets is None else targets[offset : offset + n]
            if kind == "forward":
                result = await asyncio.wrap_future(executor.forward(x, t, validation=msg.validation, tag=int(msg.step)))
                out = result.output
            else:
                grad = None if schema.is_last else self._grad(grad, n)
                rid = f"{msg.request_id}#{index}" if acc["streamed"] else msg.request_id
                result = await asyncio.wrap_future(executor.backward(x, grad, t, rid, int(msg.step)))
                out = result.grad_input
                acc["accumulated_step"] = max(acc.get("accumulated_step", 0), result.accumulated_step)
                acc["duplicate"] = acc.get("duplicate", True) and result.duplicate
            if result.loss is not None:
                acc["loss_sum"] = acc.get("loss_sum", 0.0) + float(result.loss.double().sum())
            acc["samples"] = acc.get("samples", 0) + n
            acc["compute_s"] = acc.get("compute_s", 0.0) + result.compute_s
            if out is not None:
                acc["out_shape"] = (acc.get("out_shape", (0,))[0] + out.shape[0], *out.shape[1:])
                counts = split_samples(n, out[0].numel() * out.element_size()) if acc["streamed"] else [n]
                start = 0
                for c in counts:
                    acc.setdefault("out_counts", []).append(c)
                    yield codec.encode(out[start : start + c], msg.reply_codec)
                    start += c
            offset += n
            index += 1

    async def _wait_for_step(self, executor: StageExecutor, step: int) -> None:
        """Exact mode: the trainer may reach this peer a moment before it has applied the update its
        stage-mate already applied (they apply the same averaged gradient, not at the same instant).
        Computing with the older parameters would break exactness, so the request waits for it."""
        deadline = time.monotonic() + self.serving.step_wait_s
        while executor.step < step:
            if time.monotonic() > deadline or self.serving.executor is not executor:
                raise RequestError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"peer is at step {executor.step}; the request is for step {step}",
                )
            await asyncio.sleep(0.005)  # the step changes on the compute thread; a poll is enough here

    def _response(self, kind: str, msg, executor: StageExecutor, acc: dict, first):
        cls = pb.ForwardResponse if kind == "forward" else pb.BackwardResponse
        response = cls(request_id=msg.request_id, peer_step=executor.step, compute_s=acc.get("compute_s", 0.0))
        if "loss_sum" in acc:
            response.loss = acc["loss_sum"] / max(1, acc["samples"])
        if kind == "backward":
            response.accumulated_step = acc.get("accumulated_step", 0)
            response.duplicate = acc.get("duplicate", False)
        if first is not None:
            field = response.output if kind == "forward" else response.grad_input
            field.dtype, field.codec, field.block_size = first.dtype, first.codec, first.block_size
            field.shape[:] = acc["out_shape"]
            if not acc["streamed"]:
                field.data, field.scales = first.data, first.scales
        return response

    async def _guarded(self, context: grpc.aio.ServicerContext, coro_fn):
        self.serving.in_flight += 1
        try:
            return await coro_fn()
        except _HANDLED as e:
            code, text = _status_of(e)
            await context.abort(code, text)
        finally:
            self.serving.in_flight -= 1

    async def _unary(self, kind: str, raw: bytes, context) -> bytes:
        cls = pb.ForwardRequest if kind == "forward" else pb.BackwardRequest

        async def run() -> bytes:
            msg = messages.parse(cls, raw)
            executor, schema = self._check_target(msg)
            if not msg.HasField("input"):
                raise WireError("request has no input tensor")
            x = codec.decode(msg.input, self.limits.max_numel)
            if x.dim() == 0:
                raise WireError("input must have a batch dimension")
            grad = None
            if kind == "backward" and not schema.is_last and msg.HasField("grad_output"):
                grad = codec.decode(msg.grad_output, self.limits.max_numel)
            targets = self._targets(msg, schema, x.shape[0])

            async def one_part():
                yield x.shape[0], x, grad

            acc = {"streamed": False}
            encoded = [e async for e in self._compute(kind, msg, executor, schema, targets, one_part(), acc)]
            return self._response(kind, msg, executor, acc, encoded[0] if encoded else None).SerializeToString()

        return await self._guarded(context, run)

    async def _streamed(self, kind: str, request_iterator, context) -> AsyncIterator[bytes]:
        """The streamed form (see proto/swarm.proto): parts are computed and returned as they arrive."""
        cls = pb.ForwardRequest if kind == "forward" else pb.BackwardRequest
        self.serving.in_flight += 1
        it = request_iterator.__aiter__()
        try:
            first = messages.parse(pb.Chunk, await anext(it), "stream header")
            if not first.header:
                raise WireError("stream did not start with a header chunk")
            msg = messages.parse(cls, first.header, f"{cls.__name__} header")
            executor, schema = self._check_target(msg)
            if not msg.HasField("input"):
                raise WireError("request has no input tensor")
            batch = self._check_header(msg.input, "input", schema)
            counts = list(first.parts)
            if not counts or min(counts) < 1 or sum(counts) != batch:
                raise WireError(f"stream parts {counts[:8]} do not add up to the batch of {batch}")
            streamed = [msg.input]
            if kind == "backward" and not schema.is_last:
                if not msg.HasField("grad_output"):
                    raise WireError("backward on a non-last stage needs grad_output")
                if self._check_header(msg.grad_output, "grad_output", schema) != batch:
                    raise WireError("grad_output batch differs from input batch")
                streamed.append(msg.grad_output)
            targets = self._targets(msg, schema, batch)
            received = [0]

            async def next_raw() -> bytes:
                try:
                    raw = await anext(it)
                except StopAsyncIteration:
                    raise WireError("stream ended before all its parts arrived") from None
                received[0] += len(raw)
                if received[0] > self.limits.max_message_bytes:
                    raise MessageTooLarge(
                        f"stream carries more than the limit of {self.limits.max_message_bytes} bytes"
                    )
                return raw

            async def parts():
                for n in counts:
                    decoded = []
                    for header in streamed:
                        part = pb.Tensor(
                            dtype=header.dtype,
                            shape=[n, *header.shape[1:]],
                            codec=header.codec,
                            block_size=header.block_size,
                        )
                        data = await next_raw()
                        scales = await next_raw() if header.codec == pb.CODEC_INT8_BLOCK else b""
                        decoded.append(codec.decode(part, self.limits.max_numel, data, scales))
                    yield n, decoded[0], decoded[1] if len(decoded) > 1 else None
                try:
                    await anext(it)
                except StopAsyncIteration:
                    return
                raise WireError("stream carries more messages than its parts")

            acc = {"streamed": True}
            first_out = None
            async for enc in self._compute(kind, msg, executor, schema, targets, parts(), acc):
                first_out = first_out or enc
                yield enc.data
                if enc.codec == pb.CODEC_INT8_BLOCK:
                    yield enc.scales
            response = self._response(kind, msg, executor, acc, first_out)
            context.set_trailing_metadata(
                (
                    (RESPONSE_KEY, response.SerializeToString()),
                    (PARTS_KEY, ",".join(map(str, acc.get("out_counts", [])))),
                )
            )
        except (StopAsyncIteration, *_HANDLED) as e:
            if isinstance(e, StopAsyncIteration):
                e = WireError("stream ended before all its parts arrived")
            if isinstance(e, WireError):
                # read what the client is still sending before answering: aborting mid-stream races
                # the client's writes and can turn the clear status into a generic INTERNAL error
                await _drain(it, self.limits.max_message_bytes)
            code, text = _status_of(e)
            await context.abort(code, text)
        finally:
            self.serving.in_flight -= 1

    # ---- gRPC entry points ----

    async def info(self, raw: bytes, context) -> bytes:
        return self.serving.info().SerializeToString()

    async def forward(self, raw: bytes, context) -> bytes:
        return await self._unary("forward", raw, context)

    async def backward(self, raw: bytes, context) -> bytes:
        return await self._unary("backward", raw, context)

    # grpc.aio needs handlers that are async generator functions themselves to stream responses
    async def forward_stream(self, request_iterator, context) -> AsyncIterator[bytes]:
        async for message in self._streamed("forward", request_iterator, context):
            yield message

    async def backward_stream(self, request_iterator, context) -> AsyncIterator[bytes]:
        async for message in self._streamed("backward", request_iterator, context):
            yield message

    async def _stage_request(self, message_cls: type, raw: bytes, context, what: str, available: bool):
        """Parse a GetState/GetPartialGradient request and check it is for this run and stage and
        that this peer has `what` to share; abort with a clear status otherwise."""
        try:
            request = messages.parse(message_cls, raw)
        except WireError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.run_id != self.serving.run_id or request.stage != self.serving.stage:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer serves run {self.serving.run_id} stage {self.serving.stage}",
            )
        if not available or self.serving.state not in ("online", "draining"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this peer has no {what} to share now")
        return request

    async def get_state(self, raw: bytes, context) -> AsyncIterator[bytes]:
        provider = self.serving.state_provider
        await self._stage_request(pb.StateRequest, raw, context, "state", provider is not None)
        async for chunk in provider():
            yield chunk

    async def get_partial_gradient(self, raw: bytes, context) -> AsyncIterator[bytes]:
        executor = self.serving.executor
        request = await self._stage_request(pb.PartialRequest, raw, context, "gradient", executor is not None)
        try:
            async for chunk in partial_chunks(executor, request.step):
                yield chunk
        except PartialUnavailable as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Info": grpc.unary_unary_rpc_method_handler(self.info),
                "Forward": grpc.unary_unary_rpc_method_handler(self.forward),
                "Backward": grpc.unary_unary_rpc_method_handler(self.backward),
                "ForwardStream": grpc.stream_stream_rpc_method_handler(self.forward_stream),
                "BackwardStream": grpc.stream_stream_rpc_method_handler(self.backward_stream),
                "GetState": grpc.unary_stream_rpc_method_handler(self.get_state),
                "GetPartialGradient": grpc.unary_stream_rpc_method_handler(self.get_partial_gradient),
            },
        )


async def _drain(request_iterator, max_bytes: int, timeout: float = 5.0) -> None:
    async def consume() -> None:
        seen = 0
        async for raw in request_iterator:
            seen += len(raw)
            if seen > max_bytes:
                return

    try:
        await asyncio.wait_for(consume(), timeout)
    except Exception:  # noqa: BLE001 - best effort: the error status goes out either way
        pass


async def start_server(service: StageService, host: str, port: int, limits: Limits) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=channel_options(limits.max_message_bytes), maximum_concurrent_rpcs=1024)
    server.add_generic_rpc_handlers((service.handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound
