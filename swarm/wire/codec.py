"""Tensor <-> wire encoding: dtype, shape, codec and the raw little-endian buffer.

Float tensors may be compressed (fp16, bf16, 8-bit blockwise with one float32 absmax scale per block);
integer and bool tensors always travel raw. Everything is vectorized torch: no Python loops over
elements. Decoding validates the message against its own header (sizes, dtype, codec) so that a
malformed message raises `WireError` with a clear message instead of crashing the receiver.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass

import torch

from swarm.core.errors import RequestInvalid, RequestTooLarge
from swarm.wire.names import CODECS
from swarm.wire.protocol import pb

# torch.frombuffer over immutable `bytes` warns once per call; the tensors we make from received
# buffers are never written in place (they are inputs to a stage or outputs of decoding).
warnings.filterwarnings("ignore", message="The given buffer is not writable")

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise RuntimeError("swarm's wire format assumes a little-endian host")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64}

CODEC_NAMES = dict(zip(CODECS, (pb.CODEC_NONE, pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT8_BLOCK), strict=True))
CODEC_LABELS = {v: k for k, v in CODEC_NAMES.items()}

DEFAULT_BLOCK_SIZE = 256
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1 << 20
MAX_NDIM = 8


class WireError(RequestInvalid):
    """A message that cannot be decoded or does not match what the receiver expects."""


class MessageTooLarge(WireError, RequestTooLarge):
    """A message over the receiver's size limit (gRPC RESOURCE_EXHAUSTED)."""


def codec_from_name(name: str) -> int:
    try:
        return CODEC_NAMES[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; choose one of {sorted(CODEC_NAMES)}") from None


@dataclass(frozen=True)
class Encoded:
    """A tensor's encoded buffers, before they are put into a protobuf message or a stream."""

    dtype: str
    shape: tuple[int, ...]
    codec: int
    data: bytes
    scales: bytes = b""
    block_size: int = 0


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.detach().contiguous().cpu()
    if tensor.dtype == torch.bool:
        tensor = tensor.to(torch.uint8)
    # view() as bytes needs one dimension of stride 1: a 0-dim tensor or an empty one with odd
    # strides has none
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


QUANTIZE_ROWS = 1024  # blocks quantized per pass: the fp32 temporary stays in cache (1 MiB)


def quantize_int8_blockwise(flat: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantization: q = round(x / scale), scale = absmax(block) / 127.

    |x| <= absmax, so |q| <= 127 without clamping. Vectorized over blocks; the scaled values go
    through a small reused buffer instead of a full-size temporary. Only a partial last block is
    padded.
    """
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int8), torch.zeros(1)
    num_blocks = math.ceil(n / block_size)
    if n % block_size:
        padded = flat.new_zeros(num_blocks * block_size)
        padded[:n] = flat
        flat = padded
    blocks = flat.view(num_blocks, block_size)
    # amax and amin are single passes with no temporary (abs() would write a full copy)
    scales = torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).div_(127.0)
    inv = torch.where(scales > 0, scales.reciprocal(), torch.zeros_like(scales)).unsqueeze(1)
    q = torch.empty((num_blocks, block_size), dtype=torch.int8)
    tmp = torch.empty((min(QUANTIZE_ROWS, num_blocks), block_size))
    for row in range(0, num_blocks, QUANTIZE_ROWS):
        rows = min(QUANTIZE_ROWS, num_blocks - row)
        scaled = torch.mul(blocks[row : row + rows], inv[row : row + rows], out=tmp[:rows])
        q[row : row + rows].copy_(scaled.round_())
    return q.view(-1)[:n], scales


def dequantize_int8_blockwise(q: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    n = q.numel()
    num_blocks = scales.numel()
    if n == num_blocks * block_size:
        return q.to(torch.float32).view(num_blocks, block_size).mul_(scales.unsqueeze(1)).view(-1)
    out = torch.zeros(num_blocks * block_size)
    out[:n] = q
    return out.view(num_blocks, block_size).mul_(scales.unsqueeze(1)).view(-1)[:n]


def encode(tensor: torch.Tensor, codec: int = pb.CODEC_NONE, block_size: int = DEFAULT_BLOCK_SIZE) -> Encoded:
    """Encode a tensor. Non-float tensors ignore `codec` and travel raw."""
    if tensor.dtype not in DTYPE_NAMES:
        raise WireError(f"dtype {tensor.dtype} cannot be sent; supported: {sorted(DTYPES)}")
    dtype = DTYPE_NAMES[tensor.dtype]
    shape = tuple(tensor.shape)
    if tensor.dtype not in FLOAT_DTYPES:
        codec = pb.CODEC_NONE
    tensor = tensor.detach()
    if codec == pb.CODEC_NONE:
        return Encoded(dtype, shape, codec, _raw_bytes(tensor))
    if codec == pb.CODEC_FP16:
        return Encoded(dtype, shape, codec, _raw_bytes(tensor.to(torch.float16)))
    if codec == pb.CODEC_BF16:
        return Encoded(dtype, shape, codec, _raw_bytes(tensor.to(torch.bfloat16)))
    if codec == pb.CODEC_INT8_BLOCK:
        if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise WireError(f"block size {block_size} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
        flat = tensor.reshape(-1).to(torch.float32)
        q, scales = quantize_int8_blockwise(flat, block_size)
        return Encoded(dtype, shape, codec, _raw_bytes(q), _raw_bytes(scales), block_size)
    raise WireError(f"unknown codec {codec}")


def to_proto(enc: Encoded, message: pb.Tensor | None = None, with_data: bool = True) -> pb.Tensor:
    message = pb.Tensor() if message is None else message
    message.dtype = enc.dtype
    message.shape[:] = enc.shape
    message.codec = enc.codec
    message.block_size = enc.block_size
    if with_data:
        message.data = enc.data
        message.scales = enc.scales
    else:
        message.data_size = len(enc.data)
        message.scales_size = len(enc.scales)
    return message


def tensor_to_proto(tensor: torch.Tensor, codec: int = pb.CODEC_NONE, message: pb.Tensor | None = None) -> pb.Tensor:
    return to_proto(encode(tensor, codec), message)


def _check_header(message: pb.Tensor, max_numel: int) -> tuple[torch.dtype, tuple[int, ...], int]:
    if message.dtype not in DTYPES:
        raise WireError(f"unknown dtype {message.dtype!r}; supported: {sorted(DTYPES)}")
    dtype = DTYPES[message.dtype]
    if message.codec not in CODEC_LABELS:
        raise WireError(f"unknown codec {message.codec}; supported: {sorted(CODEC_NAMES)}")
    shape = tuple(int(s) for s in message.shape)
    if len(shape) > MAX_NDIM:
        raise WireError(f"tensor has {len(shape)} dimensions, more than {MAX_NDIM}")
    if any(s < 0 for s in shape):
        raise WireError(f"negative dimension in shape {list(shape)}")
    numel = math.prod(shape)
    if numel > max_numel:
        raise WireError(f"tensor of shape {list(shape)} has {numel} elements, more than the limit {max_numel}")
    if math.prod(s for s in shape if s) > max_numel:  # an empty tensor still has strides to compute
        raise WireError(f"empty tensor of shape {list(shape)} has dimensions over the limit {max_numel}")
    if message.codec != pb.CODEC_NONE and dtype not in FLOAT_DTYPES:
        raise WireError(f"codec {CODEC_LABELS[message.codec]} applies to float tensors, not {message.dtype}")
    return dtype, shape, numel


def decode(
    message: pb.Tensor,
    max_numel: int = 1 << 31,
    data: bytes | bytearray | memoryview | None = None,
    scales: bytes | bytearray | memoryview | None = None,
) -> torch.Tensor:
    """Decode a wire tensor, checking its buffer sizes against its header.

    `data` / `scales` override the message's own buffers (a streamed message keeps them outside).
    """
    dtype, shape, numel = _check_header(message, max_numel)
    codec = message.codec
    data = message.data if data is None else data
    scales = message.scales if scales is None else scales
    if codec == pb.CODEC_NONE:
        wire_dtype = torch.uint8 if dtype == torch.bool else dtype
        itemsize = torch.empty((), dtype=wire_dtype).element_size()
        if len(data) != numel * itemsize:
            raise WireError(
                f"buffer holds {len(data)} bytes but shape {list(shape)} of {message.dtype} needs {numel * itemsize}"
            )
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        out = torch.frombuffer(data, dtype=wire_dtype).view(shape)
        return out.to(torch.bool) if dtype == torch.bool else out
    if codec in (pb.CODEC_FP16, pb.CODEC_BF16):
        wire_dtype = torch.float16 if codec == pb.CODEC_FP16 else torch.bfloat16
        if len(data) != numel * 2:
            raise WireError(
                f"{CODEC_LABELS[codec]} buffer holds {len(data)} bytes, shape {list(shape)} needs {numel * 2}"
            )
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=wire_dtype).view(shape).to(dtype)
    # CODEC_INT8_BLOCK
    block_size = message.block_size
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise WireError(f"8-bit block size {block_size} outside [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]")
    num_blocks = max(1, math.ceil(numel / block_size))
    if len(data) != numel:
        raise WireError(f"8-bit buffer holds {len(data)} bytes, shape {list(shape)} needs {numel}")
    if len(scales) != num_blocks * 4:
        raise WireError(f"8-bit scales hold {len(scales)} bytes, {num_blocks} blocks need {num_blocks * 4}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    q = torch.frombuffer(data, dtype=torch.int8)
    scale_t = torch.frombuffer(scales, dtype=torch.float32)
    if not torch.isfinite(scale_t).all():
        raise WireError("8-bit scales contain NaN or infinity")
    return dequantize_int8_blockwise(q, scale_t, block_size).view(shape).to(dtype)


def encoded_nbytes(message: pb.Tensor) -> int:
    return len(message.data) + len(message.scales)
