"""Unary and streamed forms of the stage messages.

A streamed message is a header Chunk (the message with each tensor's buffers replaced by their sizes)
followed by Chunks of raw buffer bytes, in tensor-field order, data then scales. The receiver copies
the chunks once into one preallocated buffer and decodes tensors straight from it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from google.protobuf.message import DecodeError, Message

from swarm.wire import codec
from swarm.wire.codec import MessageTooLarge, WireError
from swarm.wire.protocol import pb

TENSOR_FIELDS: dict[type, tuple[str, ...]] = {
    pb.ForwardRequest: ("input", "targets"),
    pb.ForwardResponse: ("output",),
    pb.BackwardRequest: ("input", "grad_output", "targets"),
    pb.BackwardResponse: ("grad_input",),
}

DEFAULT_CHUNK_BYTES = 1 << 20


def parse(message_cls: type, raw: bytes, what: str | None = None) -> Message:
    message = message_cls()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise WireError(f"malformed {what or message_cls.__name__}: {e}") from None
    return message


@dataclass
class Received:
    """A message plus, for streamed messages, the buffers of its tensors."""

    message: Message
    buffers: dict[str, tuple[memoryview, memoryview]] = field(default_factory=dict)

    def tensor(self, name: str, max_numel: int) -> torch.Tensor | None:
        if not self.message.HasField(name):
            return None
        header = getattr(self.message, name)
        if name in self.buffers:
            data, scales = self.buffers[name]
            return codec.decode(header, max_numel, data, scales)
        return codec.decode(header, max_numel)

    def nbytes(self) -> int:
        if self.buffers:
            return sum(len(d) + len(s) for d, s in self.buffers.values())
        return sum(
            codec.encoded_nbytes(getattr(self.message, n))
            for n in TENSOR_FIELDS[type(self.message)]
            if self.message.HasField(n)
        )


def to_chunks(message: Message, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """Split a message whose tensors carry their buffers into a header chunk and data chunks."""
    header = type(message)()
    header.CopyFrom(message)
    buffers: list[bytes] = []
    for name in TENSOR_FIELDS[type(message)]:
        if not message.HasField(name):
            continue
        t = getattr(header, name)
        t.data_size, t.scales_size = len(t.data), len(t.scales)
        buffers.extend((t.data, t.scales))
        t.data, t.scales = b"", b""
    yield pb.Chunk(header=header.SerializeToString())
    for buf in buffers:
        view = memoryview(buf)
        for start in range(0, len(view), chunk_bytes):
            yield pb.Chunk(data=view[start : start + chunk_bytes].tobytes() if len(view) > chunk_bytes else buf)


async def from_chunks_async(chunks, message_cls: type, max_bytes: int) -> Received:
    """Assemble a streamed message (async iterator of raw chunk bytes or Chunk messages)."""
    assembler = _Assembler(message_cls, max_bytes)
    async for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def from_chunks(chunks: Iterable, message_cls: type, max_bytes: int) -> Received:
    assembler = _Assembler(message_cls, max_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


class _Assembler:
    def __init__(self, message_cls: type, max_bytes: int) -> None:
        self.message_cls, self.max_bytes = message_cls, max_bytes
        self.message: Message | None = None
        self.buffer: bytearray | None = None
        self.filled = 0
        self.layout: list[tuple[str, int, int]] = []

    def add(self, chunk) -> None:
        if isinstance(chunk, (bytes, bytearray)):
            chunk = parse(pb.Chunk, chunk, "stream chunk")
        if self.message is None:
            if not chunk.header:
                raise WireError("stream did not start with a header chunk")
            self.message = parse(self.message_cls, chunk.header, f"{self.message_cls.__name__} header")
            total = 0
            for name in TENSOR_FIELDS[self.message_cls]:
                if self.message.HasField(name):
                    t = getattr(self.message, name)
                    if t.data_size < 0 or t.scales_size < 0:
                        raise WireError(f"negative buffer size in the header of {name}")
                    self.layout.append((name, t.data_size, t.scales_size))
                    total += t.data_size + t.scales_size
            if total > self.max_bytes:
                raise MessageTooLarge(f"streamed message announces {total} bytes, more than the limit {self.max_bytes}")
            self.buffer = bytearray(total)
            if chunk.data:
                self._append(chunk.data)
            return
        if chunk.header:
            raise WireError("a stream carries one header chunk only")
        self._append(chunk.data)

    def _append(self, data: bytes) -> None:
        end = self.filled + len(data)
        if end > len(self.buffer):
            raise WireError(f"stream carries more data than its header announced ({len(self.buffer)} bytes)")
        self.buffer[self.filled : end] = data
        self.filled = end

    def finish(self) -> Received:
        if self.message is None:
            raise WireError("empty stream: no header chunk")
        if self.filled != len(self.buffer):
            raise WireError(f"stream ended after {self.filled} of {len(self.buffer)} announced bytes")
        view = memoryview(self.buffer)
        buffers, offset = {}, 0
        for name, data_size, scales_size in self.layout:
            buffers[name] = (
                view[offset : offset + data_size],
                view[offset + data_size : offset + data_size + scales_size],
            )
            offset += data_size + scales_size
        return Received(self.message, buffers)
