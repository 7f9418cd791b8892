"""WireTensor: an encoded tensor split along its first (sample) dimension into parts.

A small tensor is one part and travels inside a unary message (`pb.Tensor`). A large one travels as a
stream of parts: the receiving peer computes each part as it arrives and streams the results back,
so sending, computing and returning overlap instead of adding up. Each part is encoded on its own
(8-bit blocks never straddle two parts), so a part can be decoded, or relayed to the next stage
unchanged, without the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from swarm.wire import codec
from swarm.wire.codec import DTYPE_NAMES, DTYPES
from swarm.wire.protocol import pb

PART_BYTES = 1 << 20  # target size of one streamed part


@dataclass
class Part:
    samples: int
    data: bytes | bytearray | memoryview
    scales: bytes | bytearray | memoryview = b""

    @property
    def nbytes(self) -> int:
        return len(self.data) + len(self.scales)


@dataclass
class WireTensor:
    dtype: str
    shape: tuple[int, ...]  # of the whole tensor
    codec: int
    block_size: int = 0
    parts: list[Part] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def samples(self) -> int:
        return self.shape[0] if self.shape else 1

    def part_header(self, part: Part) -> pb.Tensor:
        return pb.Tensor(
            dtype=self.dtype, shape=[part.samples, *self.shape[1:]], codec=self.codec, block_size=self.block_size
        )

    # ---- building ----

    @classmethod
    def encode(cls, tensor: torch.Tensor, codec_id: int, counts: list[int] | None = None) -> WireTensor:
        """Encode in parts of `counts` samples (default: the canonical split, see `split_samples`)."""
        if tensor.dim() == 0:
            enc = codec.encode(tensor, codec_id)
            return cls(enc.dtype, enc.shape, enc.codec, enc.block_size, [Part(1, enc.data, enc.scales)])
        if counts is None:
            counts = split_samples(tensor.shape[0], tensor[0].numel() * tensor.element_size() if tensor.shape[0] else 1)
        parts, first, start = [], None, 0
        for n in counts:
            enc = codec.encode(tensor[start : start + n], codec_id)
            first = first or enc
            parts.append(Part(n, enc.data, enc.scales))
            start += n
        if first is None:  # an empty batch
            first = codec.encode(tensor, codec_id)
            parts = [Part(0, first.data, first.scales)]
        return cls(first.dtype, tuple(tensor.shape), first.codec, first.block_size, parts)

    def resplit(self, counts: list[int]) -> WireTensor:
        """The same tensor in parts of `counts` samples. Raw and 16-bit parts are cut by byte offsets
        (no decoding); 8-bit parts, whose blocks would straddle the cuts, are decoded and re-encoded."""
        if [p.samples for p in self.parts] == counts:
            return self
        if self.codec == pb.CODEC_INT8_BLOCK:
            return WireTensor.encode(self.decode(), self.codec, counts)
        per_sample = sample_bytes(self.dtype, self.shape, self.codec)
        whole = self.parts[0].data if len(self.parts) == 1 else b"".join(bytes(p.data) for p in self.parts)
        view, parts, offset = memoryview(whole), [], 0
        for n in counts:
            parts.append(Part(n, view[offset : offset + n * per_sample]))
            offset += n * per_sample
        return WireTensor(self.dtype, self.shape, self.codec, self.block_size, parts)

    @classmethod
    def from_proto(cls, message: pb.Tensor) -> WireTensor:
        shape = tuple(int(s) for s in message.shape)
        return cls(
            message.dtype,
            shape,
            message.codec,
            message.block_size,
            [Part(shape[0] if shape else 1, message.data, message.scales)],
        )

    # ---- using ----

    def decode(self, max_numel: int = 1 << 31) -> torch.Tensor:
        decoded = [codec.decode(self.part_header(p), max_numel, p.data, p.scales) for p in self.parts]
        if len(decoded) == 1:
            return decoded[0].view(self.shape) if self.shape else decoded[0].view(())
        return torch.cat(decoded)

    def to_proto(self, message: pb.Tensor | None = None) -> pb.Tensor:
        """One unary message. Parts of raw/fp16/bf16 tensors concatenate; 8-bit parts are re-encoded."""
        message = pb.Tensor() if message is None else message
        if len(self.parts) == 1:
            p = self.parts[0]
            message.dtype, message.codec, message.block_size = self.dtype, self.codec, self.block_size
            message.shape[:] = self.shape
            message.data, message.scales = bytes(p.data), bytes(p.scales)
            return message
        if self.codec == pb.CODEC_INT8_BLOCK:
            return codec.to_proto(codec.encode(self.decode(), self.codec, self.block_size), message)
        message.dtype, message.codec, message.block_size = self.dtype, self.codec, self.block_size
        message.shape[:] = self.shape
        message.data = b"".join(bytes(p.data) for p in self.parts)
        return message


def split_samples(total: int, per_sample_bytes: int, part_bytes: int = PART_BYTES) -> list[int]:
    """The canonical split of `total` samples into parts of about `part_bytes`: the same on every
    process, so that tensors of the same shape arrive already split the same way."""
    if total <= 0:
        return [0]
    k = max(1, part_bytes // max(1, per_sample_bytes))
    return [min(k, total - start) for start in range(0, total, k)]


def sample_bytes(dtype: str, shape: tuple[int, ...], codec_id: int) -> int:
    """Encoded bytes of one sample's data (without 8-bit scales)."""
    per_sample = math.prod(shape[1:]) if len(shape) > 1 else 1
    if codec_id == pb.CODEC_NONE:
        t = DTYPES[dtype]
        itemsize = 1 if t == torch.bool else torch.empty((), dtype=t).element_size()
        return per_sample * itemsize
    return per_sample * (2 if codec_id in (pb.CODEC_FP16, pb.CODEC_BF16) else 1)


__all__ = ["Part", "WireTensor", "PART_BYTES", "sample_bytes", "split_samples", "DTYPE_NAMES"]
