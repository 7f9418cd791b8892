"""Hypothesis strategies shared by the fuzz targets: byte mutations of valid encodings, torch tensors
(with NaN, infinities, extremes), wire tensor headers that lie (huge, negative and zero dimensions,
unknown dtypes and codecs, block sizes, buffers of the wrong length), JSON texts (deep, huge numbers,
NaN) and nested values for the DHT records."""

from __future__ import annotations

import json
import math
import random

import torch
from hypothesis import strategies as st

from swarm.wire import codec
from swarm.wire.protocol import pb

INT64 = (-(1 << 63), (1 << 63) - 1)
INT32 = (-(1 << 31), (1 << 31) - 1)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ALL_DTYPES = tuple(codec.DTYPES.values())
CODEC_IDS = (pb.CODEC_NONE, pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT8_BLOCK)
SPECIAL_FLOATS = (math.nan, math.inf, -math.inf, -0.0, 1e-45, 3.4e38, 65504.0, 70000.0)

# ---- bytes ----

MUTATIONS = ("flip", "set", "insert", "delete", "truncate", "duplicate", "varint")
_mutation = st.tuples(st.sampled_from(MUTATIONS), st.integers(0, 1 << 20), st.integers(0, 255), st.integers(1, 48))


def apply_mutations(data: bytes, ops: list[tuple[str, int, int, int]]) -> bytes:
    """Apply (kind, position, byte, length) mutations; positions wrap around the current length."""
    buf = bytearray(data)
    for kind, pos, byte, length in ops:
        n = len(buf)
        p = pos % (n + 1)
        if kind == "flip" and n:
            buf[p % n] ^= 1 << (byte % 8)
        elif kind == "set" and n:
            buf[p % n] = byte
        elif kind == "insert":
            buf[p:p] = bytes([byte]) * length
        elif kind == "delete":
            del buf[p : p + length]
        elif kind == "truncate":
            del buf[p:]
        elif kind == "duplicate":
            buf[p:p] = buf[p : p + length]
        elif kind == "varint":  # a 10-byte varint: a huge length or value in a protobuf field
            buf[p:p] = b"\xff" * 9 + bytes([byte % 2])
    return bytes(buf)


def random_mutations(rng: random.Random, most: int = 3) -> list[tuple[str, int, int, int]]:
    """1..most mutations drawn from `rng` (for a target's derived cases)."""
    return [
        (rng.choice(MUTATIONS), rng.randrange(1 << 20), rng.randrange(256), rng.randrange(1, 49))
        for _ in range(rng.randint(1, most))
    ]


def derive_bytes(data: bytes, rng: random.Random) -> bytes:
    return apply_mutations(data, random_mutations(rng))


def mutated(base: st.SearchStrategy[bytes], max_ops: int = 4) -> st.SearchStrategy[bytes]:
    """`base` with 0..max_ops byte mutations."""
    return st.tuples(base, st.lists(_mutation, max_size=max_ops)).map(lambda t: apply_mutations(*t))


def random_bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


@st.composite
def mutated_chunks(draw, chunks: list[bytes]) -> list[bytes]:
    chunks = list(chunks)
    """`chunks` (a stream's messages), perhaps with messages dropped, repeated, swapped, inserted,
    cut off, or with their bytes mutated (one time in four)."""
    ops = st.lists(st.sampled_from(("drop", "repeat", "swap", "insert", "bytes", "cut")), min_size=1, max_size=3)
    for op in draw(st.sampled_from(range(4)).flatmap(lambda i: st.just([]) if i < 3 else ops)):
        i = draw(st.integers(0, max(0, len(chunks) - 1)))
        if op == "insert" or not chunks:
            chunks.insert(i, draw(st.binary(max_size=32)))
        elif op == "drop":
            del chunks[i]
        elif op == "repeat":
            chunks.insert(i, chunks[i])
        elif op == "swap":
            j = draw(st.integers(0, len(chunks) - 1))
            chunks[i], chunks[j] = chunks[j], chunks[i]
        elif op == "bytes":
            chunks[i] = apply_mutations(chunks[i], draw(st.lists(_mutation, min_size=1, max_size=3)))
        else:
            chunks = chunks[:i]
    return chunks


# ---- tensors ----


@st.composite
def torch_tensors(draw, dtypes=ALL_DTYPES, shape: list[int] | None = None, max_dims: int = 4, max_side: int = 6):
    """A tensor of one of `dtypes`: random values at a random scale (float), a few special values."""
    dtype = draw(st.sampled_from(dtypes))
    if shape is None:
        shape = draw(st.lists(st.integers(0, max_side), max_size=max_dims))
    gen = torch.Generator().manual_seed(draw(st.integers(0, (1 << 32) - 1)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        scale = draw(st.sampled_from((0.0, 1e-40, 1e-3, 1.0, 1e4, 7e4, 1e38, 1e300)))
        t = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        flat = t.view(-1)
        for index, value in draw(
            st.lists(st.tuples(st.integers(0, 1 << 20), st.sampled_from(SPECIAL_FLOATS)), max_size=2)
        ):
            if flat.numel():
                flat[index % flat.numel()] = value
        return t
    info = torch.iinfo(dtype)
    lo, hi = draw(st.sampled_from(((0, 64), (-3, 3), (info.min, info.max))))
    return torch.randint(max(lo, info.min), min(hi, info.max), shape, generator=gen, dtype=dtype)


def encode_proto(tensor: torch.Tensor, codec_id: int, block_size: int = codec.DEFAULT_BLOCK_SIZE) -> pb.Tensor:
    """A request's tensor on the wire. Its strides are made the default ones first: `codec.encode`
    fails on some empty ones (the decode target's round trip finds that; requests need not)."""
    if tensor.dim():
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    return codec.to_proto(codec.encode(tensor, codec_id, block_size))


@st.composite
def encoded_tensors(draw, dtypes=ALL_DTYPES, shape: list[int] | None = None) -> pb.Tensor:
    """A valid wire tensor (at least one dimension): a random tensor encoded with a random codec and
    block size."""
    tensor = draw(torch_tensors(dtypes, shape if shape is not None else draw(st.lists(st.integers(0, 6), 1, 4))))
    block = draw(st.sampled_from((codec.MIN_BLOCK_SIZE, 16, codec.DEFAULT_BLOCK_SIZE, 1000)))
    return encode_proto(tensor, draw(st.sampled_from(CODEC_IDS)), block)


DIMS = st.one_of(
    st.integers(0, 8),
    st.integers(*INT64),
    st.sampled_from((1 << 31, (1 << 32) + 1, 1 << 62, INT64[1], -1, 1 << 20, 3 << 16)),
)
DTYPE_NAMES = st.one_of(st.sampled_from(sorted(codec.DTYPES)), st.text(max_size=12))
CODEC_VALUES = st.one_of(st.sampled_from(CODEC_IDS), st.integers(0, INT32[1]))
BLOCK_SIZES = st.one_of(
    st.sampled_from((0, 7, 8, 256, codec.MAX_BLOCK_SIZE, codec.MAX_BLOCK_SIZE + 1)), st.integers(*INT32)
)


def _buffer_length(declared: int, draw) -> int:
    """Mostly the length the header asks for (when small), else a little off, else anything."""
    choice = draw(st.sampled_from(("exact", "exact", "off", "any")))
    if choice == "exact" and 0 <= declared <= 1 << 19:
        return declared
    if choice == "off" and 0 <= declared <= 1 << 19:
        return max(0, declared + draw(st.sampled_from((-4, -1, 1, 2, 4))))
    return draw(st.integers(0, 300))


@st.composite
def tensor_messages(draw) -> pb.Tensor:
    """A wire tensor whose header may lie: any dtype string, shape, codec and block size, with
    buffers of the matching length or not."""
    shape = draw(st.lists(DIMS, max_size=10))
    message = pb.Tensor(dtype=draw(DTYPE_NAMES), shape=shape, codec=draw(CODEC_VALUES), block_size=draw(BLOCK_SIZES))
    numel = math.prod(shape) if all(d >= 0 for d in shape) else -1
    dtype = codec.DTYPES.get(message.dtype, torch.float32)
    raw_itemsize = 1 if dtype == torch.bool else torch.empty((), dtype=dtype).element_size()
    itemsize = {pb.CODEC_NONE: raw_itemsize, pb.CODEC_INT8_BLOCK: 1}.get(message.codec, 2)
    seed = draw(st.integers(0, 1 << 30))
    message.data = random_bytes(_buffer_length(numel * itemsize if numel >= 0 else -1, draw), seed)
    if message.codec == pb.CODEC_INT8_BLOCK or draw(st.booleans()):
        blocks = max(1, math.ceil(numel / max(1, message.block_size))) if numel >= 0 else -1
        message.scales = random_bytes(_buffer_length(4 * blocks if blocks >= 0 else -1, draw), seed + 1)
    return message


# ---- JSON and nested values ----

BIG_INTS = st.one_of(st.integers(), st.sampled_from((1 << 63, 1 << 64, -(1 << 63) - 1, 10**300)))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), BIG_INTS, st.floats(), st.text(max_size=20))
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)


@st.composite
def deep_json(draw) -> str:
    """Deeply nested arrays or objects (a JSON parser's recursion), or a number too long to convert."""
    depth = draw(st.integers(1, 100_000))
    kind = draw(st.sampled_from(("array", "object", "digits", "exponent")))
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    if kind == "digits":
        return "9" * min(depth, 20_000)
    return f"1e{depth}"


def json_text(value) -> str:
    return json.dumps(value, allow_nan=True)


HASHABLE = st.one_of(st.text(max_size=12), st.binary(max_size=12), st.integers(*INT64), st.booleans())


PACKABLE_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(("x" * 1000, "y" * 81, "z" * 401, b"\x00" * 1025)),
)
PACKABLE_VALUES = st.recursive(
    PACKABLE_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(HASHABLE, inner, max_size=4),
    max_leaves=16,
)
PYTHON_VALUES = st.one_of(PACKABLE_VALUES, BIG_INTS, st.lists(BIG_INTS, max_size=3))
