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

from swarm.executor import NonFiniteError, StageExecutor
from swarm.models import StageSchema
from swarm.wire import codec, messages
from swarm.wire.codec import MessageTooLarge, WireError
from swarm.wire.messages import Received
from swarm.wire.options import MiB, channel_options
from swarm.wire.protocol import pb

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
        )


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


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

    def _tensors(self, received: Received, schema: StageSchema, with_grad: bool):
        lim = self.limits
        x = received.tensor("input", lim.max_numel)
        if x is None:
            raise WireError("request has no input tensor")
        schema.input.check(x, "input", lim.max_batch)
        targets = None
        if schema.is_last:
            targets = received.tensor("targets", lim.max_numel)
            if targets is None:
                raise WireError("the last stage needs targets")
            schema.targets.check(targets, "targets", lim.max_batch)
            if targets.shape[0] != x.shape[0]:
                raise WireError(f"targets batch {targets.shape[0]} differs from input batch {x.shape[0]}")
        grad = None
        if with_grad and not schema.is_last:
            grad = received.tensor("grad_output", lim.max_numel)
            if grad is None:
                raise WireError("backward on a non-last stage needs grad_output")
            if not grad.dtype.is_floating_point:
                raise WireError(f"grad_output must be a float tensor, got {grad.dtype}")
            if grad.shape[0] != x.shape[0]:
                raise WireError(f"grad_output batch {grad.shape[0]} differs from input batch {x.shape[0]}")
            if not torch.isfinite(grad).all():
                raise WireError("grad_output contains NaN or infinity")
            grad = grad.float()
        return x, targets, grad

    # ---- handlers (shared by unary and streamed forms) ----

    async def _guarded(self, context: grpc.aio.ServicerContext, coro_fn):
        self.serving.in_flight += 1
        try:
            return await coro_fn()
        except RequestError as e:
            await context.abort(e.code, e.args[0])
        except MessageTooLarge as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (WireError, NonFiniteError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (ValueError, IndexError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
        except RuntimeError as e:
            # torch raises RuntimeError on shape mismatches; "shutting down" comes from the executor
            code = grpc.StatusCode.UNAVAILABLE if "shutting down" in str(e) else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, f"{type(e).__name__}: {e}")
        finally:
            self.serving.in_flight -= 1

    async def _forward(self, received: Received) -> pb.ForwardResponse:
        msg = received.message
        executor, schema = self._check_target(msg)
        x, targets, _ = self._tensors(received, schema, with_grad=False)
        reply_codec = msg.reply_codec if msg.reply_codec in codec.CODEC_LABELS else None
        if reply_codec is None:
            raise WireError(f"unknown reply codec {msg.reply_codec}")
        result = await asyncio.wrap_future(executor.forward(x, targets, validation=msg.validation))
        response = pb.ForwardResponse(request_id=msg.request_id, peer_step=executor.step, compute_s=result.compute_s)
        if result.loss is not None:
            response.loss = float(result.loss.mean())
        else:
            codec.to_proto(codec.encode(result.output, reply_codec), response.output)
        return response

    async def _backward(self, received: Received) -> pb.BackwardResponse:
        msg = received.message
        executor, schema = self._check_target(msg)
        x, targets, grad = self._tensors(received, schema, with_grad=True)
        if msg.reply_codec not in codec.CODEC_LABELS:
            raise WireError(f"unknown reply codec {msg.reply_codec}")
        result = await asyncio.wrap_future(executor.backward(x, grad, targets, msg.request_id, int(msg.step)))
        response = pb.BackwardResponse(
            request_id=msg.request_id,
            peer_step=executor.step,
            accumulated_step=result.accumulated_step,
            compute_s=result.compute_s,
            duplicate=result.duplicate,
        )
        if result.loss is not None:
            response.loss = float(result.loss.mean())
        if result.grad_input is not None:
            codec.to_proto(codec.encode(result.grad_input, msg.reply_codec), response.grad_input)
        return response

    # ---- gRPC entry points ----

    async def info(self, raw: bytes, context) -> bytes:
        return self.serving.info().SerializeToString()

    async def forward(self, raw: bytes, context) -> bytes:
        async def run():
            received = Received(messages.parse(pb.ForwardRequest, raw))
            return (await self._forward(received)).SerializeToString()

        return await self._guarded(context, run)

    async def backward(self, raw: bytes, context) -> bytes:
        async def run():
            received = Received(messages.parse(pb.BackwardRequest, raw))
            return (await self._backward(received)).SerializeToString()

        return await self._guarded(context, run)

    async def _stream(self, request_iterator, context, message_cls, handler) -> AsyncIterator[bytes]:
        async def run():
            try:
                received = await messages.from_chunks_async(
                    request_iterator, message_cls, self.limits.max_message_bytes
                )
            except WireError:
                # Read what the client is still sending before answering: aborting mid-stream races
                # the client's writes and can turn the clear status into a generic INTERNAL error.
                await _drain(request_iterator, self.limits.max_message_bytes)
                raise
            return await handler(received)

        response = await self._guarded(context, run)
        if response is not None:
            for chunk in messages.to_chunks(response):
                yield chunk.SerializeToString()

    # grpc.aio needs handlers that are async generator functions themselves to stream responses
    async def forward_stream(self, request_iterator, context) -> AsyncIterator[bytes]:
        async for chunk in self._stream(request_iterator, context, pb.ForwardRequest, self._forward):
            yield chunk

    async def backward_stream(self, request_iterator, context) -> AsyncIterator[bytes]:
        async for chunk in self._stream(request_iterator, context, pb.BackwardRequest, self._backward):
            yield chunk

    async def get_state(self, raw: bytes, context) -> AsyncIterator[bytes]:
        request = messages.parse(pb.StateRequest, raw)
        provider = self.serving.state_provider
        if request.run_id != self.serving.run_id or request.stage != self.serving.stage:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this peer serves run {self.serving.run_id} stage {self.serving.stage}",
            )
        if provider is None or self.serving.state not in ("online", "draining"):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this peer has no state to share now")
        async for chunk in provider():
            yield chunk

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
