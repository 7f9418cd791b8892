"""Client side of the `Stage` service: unary calls for small tensors, streams for large ones."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from swarm.wire import messages
from swarm.wire.messages import Received
from swarm.wire.options import MiB, channel_options
from swarm.wire.protocol import pb

DEFAULT_STREAM_THRESHOLD = 2 * MiB


class StageClient:
    """One channel to one peer. All calls take a deadline in seconds."""

    def __init__(
        self,
        address: str,
        max_message_bytes: int = 256 * MiB,
        stream_threshold: int = DEFAULT_STREAM_THRESHOLD,
    ) -> None:
        self.address = address
        self.max_message_bytes = max_message_bytes
        self.stream_threshold = stream_threshold
        self.channel = grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))
        ser = lambda m: m.SerializeToString()  # noqa: E731
        self._info = self.channel.unary_unary(
            "/swarm.Stage/Info", request_serializer=ser, response_deserializer=pb.InfoResponse.FromString
        )
        self._forward = self.channel.unary_unary(
            "/swarm.Stage/Forward", request_serializer=ser, response_deserializer=None
        )
        self._backward = self.channel.unary_unary(
            "/swarm.Stage/Backward", request_serializer=ser, response_deserializer=None
        )
        self._forward_stream = self.channel.stream_stream(
            "/swarm.Stage/ForwardStream", request_serializer=ser, response_deserializer=None
        )
        self._backward_stream = self.channel.stream_stream(
            "/swarm.Stage/BackwardStream", request_serializer=ser, response_deserializer=None
        )
        self._get_state = self.channel.unary_stream(
            "/swarm.Stage/GetState", request_serializer=ser, response_deserializer=None
        )

    async def info(self, timeout: float) -> pb.InfoResponse:
        return await self._info(pb.InfoRequest(), timeout=timeout)

    async def _call(self, request, unary, stream, response_cls, timeout: float) -> Received:
        size = sum(
            len(getattr(request, n).data) + len(getattr(request, n).scales)
            for n in messages.TENSOR_FIELDS[type(request)]
            if request.HasField(n)
        )
        if size < self.stream_threshold:
            raw = await unary(request, timeout=timeout)
            return Received(messages.parse(response_cls, raw))
        call = stream(messages.to_chunks(request), timeout=timeout)
        return await messages.from_chunks_async(call, response_cls, self.max_message_bytes)

    async def forward(self, request: pb.ForwardRequest, timeout: float) -> Received:
        return await self._call(request, self._forward, self._forward_stream, pb.ForwardResponse, timeout)

    async def backward(self, request: pb.BackwardRequest, timeout: float) -> Received:
        return await self._call(request, self._backward, self._backward_stream, pb.BackwardResponse, timeout)

    def get_state(self, request: pb.StateRequest, timeout: float) -> AsyncIterator[bytes]:
        return self._get_state(request, timeout=timeout)

    async def close(self) -> None:
        await self.channel.close(grace=None)
