"""Reading the streamed form of a Forward/Backward request (see proto/swarm.proto): a header chunk
(the request without its large tensors, and the samples per part), then each part's raw buffers.
Headers are checked against the stage's schema before any part is read; each part is decoded as it
arrives so that the peer computes while the rest is still on the wire."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import torch

from swarm.peer.requests import check_header, input_left_out
from swarm.peer.serving import Limits
from swarm.training.models import StageSchema
from swarm.wire import codec, messages
from swarm.wire.codec import MessageTooLarge, WireError
from swarm.wire.protocol import pb

DRAIN_TIMEOUT_S = 5.0


class StreamedRequest:
    def __init__(self, kind: str, request_iterator, limits: Limits) -> None:
        self.kind, self.limits = kind, limits
        self._it = request_iterator.__aiter__()
        self.msg = None
        self.counts: list[int] = []
        self._streamed: list[tuple[str, pb.Tensor]] = []
        self._received = 0

    async def _next_raw(self) -> bytes:
        try:
            async with asyncio.timeout(self.limits.stream_read_timeout_s):
                raw = await anext(self._it)
        except StopAsyncIteration:
            raise WireError("stream ended before all its parts arrived") from None
        except TimeoutError:
            raise WireError(f"stream sent nothing for {self.limits.stream_read_timeout_s:.0f} s") from None
        self._received += len(raw)
        if self._received > self.limits.max_message_bytes:
            raise MessageTooLarge(f"stream carries more than the limit of {self.limits.max_message_bytes} bytes")
        return raw

    async def read_header(self):
        """The request message of the header chunk (its tensors carry no data)."""
        first = messages.parse(pb.Chunk, await self._next_raw(), "stream header")
        if not first.header:
            raise WireError("stream did not start with a header chunk")
        cls = pb.ForwardRequest if self.kind == "forward" else pb.BackwardRequest
        self.msg = messages.parse(cls, first.header, f"{cls.__name__} header")
        self.counts = list(first.parts)
        return self.msg

    def check_tensors(self, schema: StageSchema) -> int:
        """Check the streamed tensors' headers and the parts' sample counts; returns the batch size."""
        msg = self.msg
        left_out = self.kind == "backward" and input_left_out(msg, schema, self.limits)
        if not left_out and not msg.HasField("input"):
            raise WireError("request has no input tensor")
        batch = msg.num_samples if left_out else check_header(msg.input, "input", schema, self.limits)
        if not self.counts or min(self.counts) < 1 or sum(self.counts) != batch:
            raise WireError(f"stream parts {self.counts[:8]} do not add up to the batch of {batch}")
        self._streamed = [] if left_out else [("input", msg.input)]
        if self.kind == "backward" and not schema.is_last:
            if not msg.HasField("grad_output"):
                raise WireError("backward on a non-last stage needs grad_output")
            if check_header(msg.grad_output, "grad_output", schema, self.limits) != batch:
                raise WireError("grad_output batch differs from input batch")
            self._streamed.append(("grad_output", msg.grad_output))
        return batch

    async def parts(self) -> AsyncIterator[tuple[int, torch.Tensor | None, torch.Tensor | None]]:
        """(samples, input, grad_output or None) of each part, decoded as it arrives; the input is None
        when a backward left it out (requests.input_left_out)."""
        for n in self.counts:
            decoded = {}
            for name, header in self._streamed:
                part = pb.Tensor(dtype=header.dtype, shape=[n, *header.shape[1:]], codec=header.codec)
                part.block_size = header.block_size
                data = await self._next_raw()
                scales = await self._next_raw() if header.codec == pb.CODEC_INT8_BLOCK else b""
                decoded[name] = codec.decode(part, self.limits.max_numel, data, scales)
            yield n, decoded.get("input"), decoded.get("grad_output")
        try:
            await anext(self._it)
        except StopAsyncIteration:
            return
        raise WireError("stream carries more messages than its parts")

    async def drain(self) -> None:
        """Read (and drop) what the client is still sending, up to the size limit and a deadline."""

        async def consume() -> None:
            seen = 0
            async for raw in self._it:
                seen += len(raw)
                if seen > self.limits.max_message_bytes:
                    return

        try:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                await consume()
        except Exception:  # noqa: BLE001 - best effort: the error status goes out either way
            pass
