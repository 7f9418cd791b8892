"""Client side of the `Stage` service: unary calls for small tensors, streams for large ones; Forward
and Backward over the peer's lane (swarm.wire.lane) when it has one and the swarm is open."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from google.protobuf.message import Message

from swarm.wire import stream
from swarm.wire.auth import MemberCredentials, client_auth
from swarm.wire.lane import RETRY, STREAMED, LaneClient
from swarm.wire.messages import parse
from swarm.wire.options import MiB, channel_options
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor
from swarm.wire.tls import CHANNEL_OPTIONS, channel_credentials

# Requests with more tensor bytes than this are streamed part by part (a trainer's
# --stream-threshold-kb changes it, e.g. 0 to stream everything in tests).
DEFAULT_STREAM_THRESHOLD = 2 * MiB
LANE_CONNECT_S = 2.0  # longest wait to open a lane connection before the call goes over gRPC
LANE_RETRY_S = 30.0  # after a lane connection failed to open, gRPC only for this long
RETRY_KEY = "swarm-retry"  # trailing metadata of a retryable overload (swarm.peer.server.RETRY_KEY)
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def _rpc_error(code: grpc.StatusCode, details: str, retry: bool = False) -> grpc.aio.AioRpcError:
    """A lane failure as the error a gRPC call would raise (the trainer handles one kind)."""
    trailing = grpc.aio.Metadata((RETRY_KEY, "1")) if retry else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailing, details)


def _host_of(address: str) -> str:
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


class StageClient:
    """One channel to one peer. All calls take a deadline in seconds."""

    def __init__(
        self,
        address: str,
        max_message_bytes: int = 256 * MiB,
        stream_threshold: int = DEFAULT_STREAM_THRESHOLD,
        credentials: MemberCredentials | None = None,
    ) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.stream_threshold = stream_threshold
        self.use_lane = credentials is None  # a private swarm's calls carry certificates: gRPC only
        self.lane: LaneClient | None = None
        self.lane_calls = 0
        self._lane_off_until = 0.0
        # in a private swarm every call carries the member's certificate and signature, over TLS
        # (trusting only the run's CA) unless the run chose plaintext
        interceptors = client_auth(credentials) if credentials is not None else None
        options = channel_options(max_message_bytes)
        if credentials is not None and credentials.tls_ca:
            tls = channel_credentials(credentials.tls_ca)
            self.channel = grpc.aio.secure_channel(
                address, tls, options=options + CHANNEL_OPTIONS, interceptors=interceptors
            )
        else:
            self.channel = grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
        ser = lambda m: m.SerializeToString()  # noqa: E731
        self._info = self.channel.unary_unary(
            "/swarm.Stage/Info", request_serializer=ser, response_deserializer=pb.InfoResponse.FromString
        )
        self._unary = {
            "forward": self.channel.unary_unary("/swarm.Stage/Forward", request_serializer=ser),
            "backward": self.channel.unary_unary("/swarm.Stage/Backward", request_serializer=ser),
        }
        self._stream = {
            "forward": self.channel.stream_stream("/swarm.Stage/ForwardStream"),
            "backward": self.channel.stream_stream("/swarm.Stage/BackwardStream"),
        }
        self._get_state = self.channel.unary_stream("/swarm.Stage/GetState", request_serializer=ser)
        self._get_partial = self.channel.unary_stream("/swarm.Stage/GetPartialGradient", request_serializer=ser)
        self._get_contributions = self.channel.unary_unary(
            "/swarm.Stage/GetContributions",
            request_serializer=ser,
            response_deserializer=pb.ContributionsResponse.FromString,
        )
        self._get_ledger = self.channel.unary_stream("/swarm.Stage/GetLedger", request_serializer=ser)

    async def info(
        self,
        timeout: float,
        wait_for_step: int = 0,
        wait_s: float = 0.0,
        accused: Sequence[str] = (),
        seen: tuple[int, int] | None = None,
    ) -> pb.InfoResponse:
        """The peer's Info; with `wait_for_step`, once its step reaches that (or after `wait_s`);
        with `seen` (step, samples accumulated), once either differs from it (or after `wait_s`);
        `accused`: peers the caller knows accused of lying (the peer reads of them at once)."""
        request = pb.InfoRequest(wait_for_step=wait_for_step, wait_ms=round(1000 * wait_s), accused=accused)
        if seen is not None:
            request.watch, (request.seen_step, request.seen_samples) = True, seen
        return await self._info(request, timeout=timeout + wait_s)

    def set_lane(self, port: int) -> None:
        """The peer's lane port, from its Info (0: it has none)."""
        if not self.use_lane or port <= 0:
            self.lane = None
        elif self.lane is None or self.lane.port != port:
            self.lane = LaneClient(_host_of(self.address), port, self.max_message_bytes)

    async def _lane_ready(self, timeout: float) -> LaneClient | None:
        """The lane, connected; None (gRPC this time) without one, or when it cannot be opened."""
        lane = self.lane
        if lane is None or time.monotonic() < self._lane_off_until:
            return None
        try:
            await asyncio.wait_for(lane.connect(), min(timeout, LANE_CONNECT_S))
        except (OSError, TimeoutError):
            self._lane_off_until = time.monotonic() + LANE_RETRY_S
            return None
        return lane

    async def _lane_call(
        self, lane: LaneClient, kind: str, request: Message, tensors: dict[str, WireTensor], timeout: float
    ) -> tuple[Message, WireTensor | None]:
        response_cls = pb.ForwardResponse if kind == "forward" else pb.BackwardResponse
        streamed = sum(t.nbytes for t in tensors.values()) >= self.stream_threshold
        first = next(iter(tensors.values()))
        buffers = stream.request_buffers(request, tensors, None if streamed else [first.samples])
        try:
            frame = await lane.call(kind, buffers, STREAMED if streamed else 0, timeout)
        except TimeoutError:
            raise _rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded (lane)") from None
        except OSError as e:
            raise _rpc_error(grpc.StatusCode.UNAVAILABLE, f"lane: {e}") from None
        self.lane_calls += 1
        if frame.status:
            details = bytes(frame.segments[0]).decode(errors="replace") if frame.segments else ""
            code = STATUS_CODES.get(frame.status, grpc.StatusCode.UNKNOWN)
            raise _rpc_error(code, details, bool(frame.flags & RETRY))
        if not frame.segments:
            raise _rpc_error(grpc.StatusCode.INTERNAL, "lane: an empty response frame")
        head = parse(pb.Chunk, frame.segments[0], "lane response")
        trailing = {stream.RESPONSE_KEY: head.header, stream.PARTS_KEY: ",".join(map(str, head.parts))}
        return stream.assemble_response(response_cls, frame.segments[1:], trailing)

    async def call(
        self, kind: str, request: Message, tensors: dict[str, WireTensor], timeout: float
    ) -> tuple[Message, WireTensor | None]:
        """Forward or Backward: `request` without its streamed tensors, which come in `tensors`."""
        started = time.monotonic()
        lane = await self._lane_ready(timeout) if tensors else None
        if lane is not None:
            return await self._lane_call(lane, kind, request, tensors, timeout - (time.monotonic() - started))
        timeout -= time.monotonic() - started
        response_cls = pb.ForwardResponse if kind == "forward" else pb.BackwardResponse
        if sum(t.nbytes for t in tensors.values()) < self.stream_threshold:
            for name, tensor in tensors.items():
                tensor.to_proto(getattr(request, name))
            response = parse(response_cls, await self._unary[kind](request, timeout=timeout))
            name = stream.OUTPUT_FIELD[response_cls]
            return response, WireTensor.from_proto(getattr(response, name)) if response.HasField(name) else None
        call = self._stream[kind](iter(stream.request_messages(request, tensors)), timeout=timeout)
        raw_parts = [message async for message in call]
        trailing = {key: value for key, value in (await call.trailing_metadata() or ())}
        return stream.assemble_response(response_cls, raw_parts, trailing)

    def get_state(self, request: pb.StateRequest, timeout: float) -> AsyncIterator[bytes]:
        return self._get_state(request, timeout=timeout)

    def get_partial_gradient(self, request: pb.PartialRequest, timeout: float) -> AsyncIterator[bytes]:
        return self._get_partial(request, timeout=timeout)

    async def get_contributions(self, request: pb.ContributionsRequest, timeout: float) -> pb.ContributionsResponse:
        return await self._get_contributions(request, timeout=timeout)

    def get_ledger(self, request: pb.LedgerRequest, timeout: float) -> AsyncIterator[bytes]:
        return self._get_ledger(request, timeout=timeout)

    async def close(self) -> None:
        if self.lane is not None:
            await self.lane.close()
        await self.channel.close(grace=None)
