"""The gRPC `Stage` service of a peer: decode, validate, hand to the executor, encode.

Handlers take raw bytes (no generated deserializer) so that a malformed message gets a clear
INVALID_ARGUMENT instead of a generic INTERNAL error. Errors are typed (swarm.core.errors) and
mapped to gRPC status codes by type (`status_of`): a request's own fault is INVALID_ARGUMENT (or
RESOURCE_EXHAUSTED when too large), a request for another run or stage FAILED_PRECONDITION, a
transient state of the peer (joining, leaving its stage, shutting down) UNAVAILABLE, so that the
trainer retries elsewhere. The server keeps serving whatever it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator

import grpc

from swarm.core.auth import Verifier
from swarm.core.errors import InputNotKept, RequestInvalid, StageBehind, StepNotReady
from swarm.core.settings import INFO_PERIOD_S
from swarm.peer.admission import Admission
from swarm.peer.agreement import contributions_response, ledger_chunks
from swarm.peer.executor import StageExecutor
from swarm.peer.partials import partial_chunks
from swarm.peer.requests import check_grad_output, decode_targets, input_left_out
from swarm.peer.serving import Limits, ServingState
from swarm.peer.state_transfer import StateSnapshots
from swarm.peer.statuses import abort
from swarm.peer.streaming import StreamedRequest
from swarm.policy.polling import PollerCount, info_period
from swarm.training.models import StageSchema
from swarm.wire import codec, messages
from swarm.wire.auth import ServerAuth
from swarm.wire.codec import WireError
from swarm.wire.options import server_options
from swarm.wire.protocol import pb
from swarm.wire.stream import PARTS_KEY, RESPONSE_KEY
from swarm.wire.tensors import split_samples
from swarm.wire.tls import ServerTls

logger = logging.getLogger(__name__)

SERVICE = "swarm.Stage"

STEP_RECHECK_S = 0.05  # an exact-mode request waiting for this peer's next step re-checks its deadline this often


def _add_part(acc: dict, result, samples: int) -> None:
    """A computed part's figures into the request's: loss, samples, compute time, and the parameters
    it was computed at (-1 when a streamed request's parts straddle an update)."""
    if result.loss is not None:
        acc["loss_sum"] = acc.get("loss_sum", 0.0) + float(result.loss.double().sum())
    acc["samples"] = acc.get("samples", 0) + samples
    params = acc.setdefault("params", (result.params_step, result.predicted))
    if params != (result.params_step, result.predicted):
        acc["params"] = (-1, True)
    acc["compute_s"] = acc.get("compute_s", 0.0) + result.compute_s


class StageService:
    def __init__(self, serving: ServingState, limits: Limits) -> None:
        self.serving = serving
        self.limits = limits
        self.admission = Admission(limits)
        self.pollers = PollerCount()  # who polls this peer's Info: sets the period it asks them for
        self.states = StateSnapshots()

    # ---- computing: a request is one part (unary) or several (streamed) ----

    async def compute(self, kind: str, msg, executor: StageExecutor, schema: StageSchema, targets, parts, acc: dict):
        """Run each (samples, input, grad_output) part as it comes; yield the encoded output parts.
        Per-request figures (loss, compute time, accumulated step) are collected in `acc`."""
        await self._ready_for(msg, executor)
        offset, index = 0, 0
        token = secrets.randbits(63) + 1 if kind == "forward" else 0  # for a backward that leaves its input out
        async for n, x, grad in parts:
            if x is not None:  # None: a backward on the activations kept here (requests.input_left_out)
                schema.input.check(x, "input", self.limits.max_batch)
            t = None if targets is None else targets[offset : offset + n]
            if kind == "forward":
                fkey = f"{msg.request_id}#{index}" if acc["streamed"] else msg.request_id
                future = executor.forward(
                    x, t, validation=msg.validation, tag=int(msg.step), key=fkey, inline=True,
                    reference=msg.reference, kept_token=token,
                )  # fmt: skip
                result = future.result() if future.done() else await asyncio.wrap_future(future)
                out = result.output
                # the token is answered only if every part of the request was kept
                acc["kept_token"] = token if acc.get("kept_token", token) and result.kept else 0
            else:
                grad = None if schema.is_last else check_grad_output(grad, n)
                key = msg.contribution_id or msg.request_id
                key = f"{key}#{index}" if acc["streamed"] else key
                fkey = f"{msg.forward_id}#{index}" if acc["streamed"] and msg.forward_id else msg.forward_id
                future = executor.backward(
                    x, grad, t, key, int(msg.step), int(msg.samples_digest), check_only=msg.check_only,
                    forward_key=fkey, reference=msg.reference, kept_token=msg.kept_token, samples=n,
                )  # fmt: skip
                result = await asyncio.wrap_future(future)
                if not result.duplicate:
                    self.serving.notify_accumulated()
                out = result.grad_input
                acc["accumulated_step"] = max(acc.get("accumulated_step", 0), result.accumulated_step)
                acc["duplicate"] = acc.get("duplicate", True) and result.duplicate
                acc["epoch"] = result.epoch
                if result.holder is not None:
                    acc["holder"] = result.holder
            _add_part(acc, result, n)
            if out is not None and self.serving.lie is not None:
                out = self.serving.lie.perturb(out, executor.step)
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

    async def _ready_for(self, msg, executor: StageExecutor) -> None:
        """Checks and waits before a request's compute: its reply codec, and a training request's step
        (exact mode: until this peer has applied the step before it)."""
        if msg.reply_codec not in codec.CODEC_LABELS:
            raise WireError(f"unknown reply codec {msg.reply_codec}")
        training = not getattr(msg, "validation", False)
        ahead = training and msg.step > executor.step  # for a step this peer has not reached yet
        if training:
            self._check_step(int(msg.step), executor.step)
        if ahead and self.serving.on_run_ahead is not None:
            self.serving.on_run_ahead()
        if self.serving.exact and ahead:
            with self.admission.wait_for_step():
                await self._wait_for_step(executor, int(msg.step))
        if training and self.serving.before_compute is not None:
            await self.serving.before_compute(executor.step)

    def _check_step(self, step: int, peer_step: int) -> None:
        """A training request's step must be one this peer takes now (at most max_steps_ahead past its own)."""
        ahead = self.limits.max_steps_ahead
        if 0 <= step <= peer_step + ahead:
            return
        text = f"the request is for step {step}; this peer takes steps up to {peer_step} + {ahead}"
        if step < 0:
            raise RequestInvalid(text)
        if step <= self.serving.mates_step + ahead:
            raise StepNotReady(text)  # this peer is behind its stage (it just entered it, or was paused)
        raise StageBehind(text)  # ahead of the whole stage: it is behind the run, and catches up

    async def _wait_for_step(self, executor: StageExecutor, step: int) -> None:
        """Exact mode: the trainer may reach this peer a moment before it has applied the update its
        stage-mate already applied (they apply the same averaged gradient, not at the same instant).
        Computing with the older parameters would break exactness, so the request waits for it."""
        deadline = time.monotonic() + self.serving.step_wait_s
        while executor.step < step:
            if time.monotonic() > deadline or self.serving.executor is not executor:
                raise StepNotReady(f"peer is at step {executor.step}; the request is for step {step}")
            # woken by the apply (serving.notify_step); the short cap re-checks the deadline and a move
            await self.serving.wait_for_step(step, STEP_RECHECK_S)

    def response(self, kind: str, msg, executor: StageExecutor, acc: dict, first, inline_data: bool | None = None):
        """The response message; the output's data inline unless streamed (or `inline_data` False)."""
        cls = pb.ForwardResponse if kind == "forward" else pb.BackwardResponse
        response = cls(request_id=msg.request_id, peer_step=executor.step, compute_s=acc.get("compute_s", 0.0))
        response.params_step, response.predicted = acc.get("params", (executor.step, False))
        response.peer_s = time.monotonic() - acc["t0"]  # queue, compute and handling here
        if "loss_sum" in acc:
            response.loss = acc["loss_sum"] / max(1, acc["samples"])
        if kind == "forward":
            response.kept_token = acc.get("kept_token", 0)
        if kind == "backward":
            response.accumulated_step = acc.get("accumulated_step", 0)
            response.duplicate = acc.get("duplicate", False)
            response.epoch = acc.get("epoch", 0)
            holder = acc.get("holder")
            if holder is not None:
                response.holder = holder.peer_id or self.serving.peer_id
                response.holder_epoch = holder.epoch
        if first is not None:
            field = response.output if kind == "forward" else response.grad_input
            field.dtype, field.codec, field.block_size = first.dtype, first.codec, first.block_size
            field.shape[:] = acc["out_shape"]
            if (not acc["streamed"]) if inline_data is None else inline_data:
                field.data, field.scales = first.data, first.scales
        return response

    async def _unary(self, kind: str, raw: bytes, context) -> bytes:
        self.serving.in_flight += 1
        try:
            with self.admission.request(context.peer()):
                return await self._unary_admitted(kind, raw)
        except Exception as e:  # noqa: BLE001 - every error becomes a status; the server keeps serving
            await abort(context, e)
        finally:
            self.serving.in_flight -= 1

    async def _unary_admitted(self, kind: str, raw: bytes) -> bytes:
        acc = {"streamed": False, "t0": time.monotonic()}
        msg = messages.parse(pb.ForwardRequest if kind == "forward" else pb.BackwardRequest, raw)
        executor, schema = self.serving.check_target(msg.run_id, msg.stage)
        x = None
        if kind == "backward" and input_left_out(msg, schema, self.limits):
            batch = int(msg.num_samples)
        else:
            if not msg.HasField("input"):
                raise WireError("request has no input tensor")
            x = codec.decode(msg.input, self.limits.max_numel)
            if x.dim() == 0:
                raise WireError("input must have a batch dimension")
            batch = x.shape[0]
        grad = None
        if kind == "backward" and not schema.is_last and msg.HasField("grad_output"):
            grad = codec.decode(msg.grad_output, self.limits.max_numel)
        targets = decode_targets(msg, schema, batch, self.limits)

        async def one_part():
            yield batch, x, grad

        encoded = [e async for e in self.compute(kind, msg, executor, schema, targets, one_part(), acc)]
        return self.response(kind, msg, executor, acc, encoded[0] if encoded else None).SerializeToString()

    async def _streamed(self, kind: str, request_iterator, context) -> AsyncIterator[bytes]:
        """The streamed form (see proto/swarm.proto): parts are computed and returned as they arrive."""
        self.serving.in_flight += 1
        request = StreamedRequest(kind, request_iterator, self.limits)
        admitted = contextlib.ExitStack()
        try:
            admitted.enter_context(self.admission.stream())
            admitted.enter_context(self.admission.request(context.peer()))
            msg = await request.read_header()
            executor, schema = self.serving.check_target(msg.run_id, msg.stage)
            batch = request.check_tensors(schema)
            targets = decode_targets(msg, schema, batch, self.limits)
            acc = {"streamed": True, "t0": time.monotonic()}
            first_out = None
            async for enc in self.compute(kind, msg, executor, schema, targets, request.parts(), acc):
                first_out = first_out or enc
                yield enc.data
                if enc.codec == pb.CODEC_INT8_BLOCK:
                    yield enc.scales
            response = self.response(kind, msg, executor, acc, first_out)
            context.set_trailing_metadata(
                (
                    (RESPONSE_KEY, response.SerializeToString()),
                    (PARTS_KEY, ",".join(map(str, acc.get("out_counts", [])))),
                )
            )
        except Exception as e:  # noqa: BLE001 - every error becomes a status; the server keeps serving
            if isinstance(e, (WireError, InputNotKept)):
                # read what the client is still sending before answering: aborting mid-stream races
                # the client's writes and can turn the clear status into a generic INTERNAL error
                await request.drain()
            await abort(context, e)
        finally:
            admitted.close()
            self.serving.in_flight -= 1

    # ---- gRPC entry points ----

    async def info(self, raw: bytes, context) -> bytes:
        try:
            request = messages.parse(pb.InfoRequest, raw)
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await abort(context, e)
        if request.accused and self.serving.on_accused is not None:
            self.serving.on_accused(list(request.accused))
        if request.watch and request.wait_ms > 0:
            seen = (int(request.seen_step), int(request.seen_samples))
            await self.serving.wait_for_change(seen, request.wait_ms / 1000)
        elif request.wait_for_step > 0 and request.wait_ms > 0:
            await self.serving.wait_for_step(int(request.wait_for_step), request.wait_ms / 1000)
        answer = self.serving.info()
        answer.streams_peak = self.admission.streams_peak
        answer.accused.extend(self.serving.accused_hint())
        pollers = self.pollers.seen(context.peer() or "")
        answer.poll_period_ms = round(1000 * info_period(pollers, INFO_PERIOD_S))
        return answer.SerializeToString()

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

    async def _blob(self, message_cls: type, raw: bytes, context, chunks) -> AsyncIterator[bytes]:
        """GetState/GetPartialGradient: parse and check the request (this run and stage, a serving
        peer), then stream what `chunks(executor, request)` yields."""
        try:
            request = messages.parse(message_cls, raw)
            executor, _ = self.serving.check_target(request.run_id, request.stage)
            async for chunk in chunks(executor, request):
                yield chunk
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await abort(context, e)

    async def get_state(self, raw: bytes, context) -> AsyncIterator[bytes]:
        """GetState: one serialized snapshot per step, a few callers at a time (swarm.peer.admission)."""
        try:
            with self.admission.state_call(context.peer()):
                request = messages.parse(pb.StateRequest, raw)
                executor, _ = self.serving.check_target(request.run_id, request.stage)
                async for chunk in self.states.stream(executor):
                    yield chunk
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await abort(context, e)

    async def get_partial_gradient(self, raw: bytes, context) -> AsyncIterator[bytes]:
        chunks = functools.partial(partial_chunks, before_fetch=self.serving.before_mate_fetch)
        async for chunk in self._blob(pb.PartialRequest, raw, context, chunks):
            yield chunk

    async def get_contributions(self, raw: bytes, context) -> bytes:
        try:
            request = messages.parse(pb.ContributionsRequest, raw)
            executor, _ = self.serving.check_target(request.run_id, request.stage)
            held = executor.contributions(int(request.step))  # a snapshot under its lock, no hand-off
            if not held.frozen and held.applied_step <= request.step and self.serving.on_mate_froze is not None:
                self.serving.on_mate_froze()
            return contributions_response(self.serving.peer_id, held).SerializeToString()
        except Exception as e:  # noqa: BLE001 - every error becomes a status
            await abort(context, e)

    async def get_ledger(self, raw: bytes, context) -> AsyncIterator[bytes]:
        async for chunk in self._blob(pb.LedgerRequest, raw, context, ledger_chunks):
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
                "GetPartialGradient": grpc.unary_stream_rpc_method_handler(self.get_partial_gradient),
                "GetContributions": grpc.unary_unary_rpc_method_handler(self.get_contributions),
                "GetLedger": grpc.unary_stream_rpc_method_handler(self.get_ledger),
            },
        )


async def start_server(
    service: StageService,
    host: str,
    port: int,
    limits: Limits,
    verifier: Verifier | None = None,
    tls: ServerTls | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Serve `service` (in a private swarm, `verifier` checks every call's membership first, and
    `tls` is its server certificate unless the run chose plaintext)."""
    # no gRPC-wide cap on concurrent calls: Info must always get through (a dashboard, the trainers'
    # views); Forward/Backward/streams/GetState have their own bounds (swarm.peer.admission)
    interceptors = [ServerAuth(verifier)] if verifier is not None else None
    server = grpc.aio.server(options=server_options(limits.max_message_bytes), interceptors=interceptors)
    server.add_generic_rpc_handlers((service.handler(),))
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    return server, bound


__all__ = ["Limits", "ServingState", "StageService", "start_server"]
