"""Fuzz targets of the wire layer: `swarm.wire.codec.decode` and `swarm.wire.messages.parse`.

decode: on wire tensors whose header may lie (any dtype string, shapes with huge, negative and zero
dimensions, any codec and block size, buffers of any length) and on byte mutations of valid encodings
of random tensors with each codec. Contract: a `WireError` (RequestInvalid) or a tensor of the
header's dtype and shape with at most `MAX_NUMEL` elements; an unmutated encoding decodes back to its
tensor within the codec's error.

parse: every request (and response) message type from random bytes, deeply nested groups and
mutations of valid messages. Contract: a `WireError`, or a message that serializes and parses back
equal.
"""

from __future__ import annotations

import random

import torch
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import strategies as st

from swarm.core.checks import all_finite
from swarm.wire import codec, messages
from swarm.wire.codec import WireError
from swarm.wire.protocol import pb
from tests.fuzz import strategies as fs
from tests.fuzz.harness import ContractViolation, Target

MAX_NUMEL = 1 << 16  # the decoder's element limit in these runs (512 KiB of float64 at most)


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise ContractViolation(what)


# ---- decode ----


def decode_checked(message: pb.Tensor, max_numel: int = MAX_NUMEL) -> torch.Tensor | None:
    """The decoded tensor, None if refused with a WireError; raises on a broken contract."""
    try:
        out = codec.decode(message, max_numel)
    except WireError:
        return None
    expect(isinstance(out, torch.Tensor), "decode returned a non-tensor")
    expect(out.dtype == codec.DTYPES[message.dtype], f"decoded another dtype than the header's\n{out.dtype}")
    expect(list(out.shape) == list(message.shape), f"decoded another shape than the header's\n{list(out.shape)}")
    expect(out.numel() <= max_numel, f"decoded more elements than the limit\n{out.numel()}")
    return out


def _codec_tolerance(original: torch.Tensor, codec_id: int, block_size: int) -> torch.Tensor:
    """The largest error each element may have after an 8-bit round trip: half a quantization step
    (absmax of its block / 254) plus the rounding of the float32 pass and of the tensor's own dtype."""
    flat = original.reshape(-1).to(torch.float64)
    n = flat.numel()
    blocks = torch.zeros(-(-n // block_size) * block_size, dtype=torch.float64)
    blocks[:n] = flat.abs()
    absmax = blocks.view(-1, block_size).amax(dim=1).repeat_interleave(block_size)[:n]
    eps = torch.finfo(original.dtype).eps
    return (absmax / 254 * 1.001 + flat.abs() * 2 * eps + 1e-30).view(original.shape)


def _round_trip_matches(original: torch.Tensor, decoded: torch.Tensor, codec_id: int, block_size: int) -> bool:
    if not original.dtype.is_floating_point:
        return torch.equal(original, decoded)
    if codec_id == pb.CODEC_NONE:
        return bool(((original == decoded) | (original.isnan() & decoded.isnan())).all())
    if codec_id in (pb.CODEC_FP16, pb.CODEC_BF16):
        wire = torch.float16 if codec_id == pb.CODEC_FP16 else torch.bfloat16
        expected = original.to(wire).to(original.dtype)
        return bool(((expected == decoded) | (expected.isnan() & decoded.isnan())).all())
    error = (decoded.to(torch.float64) - original.to(torch.float64)).abs()
    return bool((error <= _codec_tolerance(original, codec_id, block_size)).all())


def _check_round_trip(case: tuple) -> str:
    _, tensor, codec_id, block_size, ops = case
    encoded = codec.to_proto(codec.encode(tensor, codec_id, block_size))
    raw = fs.apply_mutations(encoded.SerializeToString(), ops)
    try:
        message = messages.parse(pb.Tensor, raw)
    except WireError:
        expect(bool(ops), "a valid encoding does not parse")
        return "rejected"
    decoded = decode_checked(message)
    if ops:
        return "rejected" if decoded is None else "decoded"
    finite = all_finite(tensor.to(torch.float32)) if tensor.dtype.is_floating_point else True
    if decoded is None:
        expect(encoded.codec == pb.CODEC_INT8_BLOCK and not finite, f"a valid encoding was refused\n{encoded}")
        return "rejected"
    effective = encoded.codec  # integer tensors always travel raw
    expect(_round_trip_matches(tensor, decoded, effective, block_size), "the round trip changed the tensor")
    return "round trip"


def check_decode(case: tuple) -> str:
    if case[0] == "bytes":
        try:
            message = messages.parse(pb.Tensor, case[1])
        except WireError:
            return "rejected"
        return "rejected" if decode_checked(message) is None else "decoded"
    if case[0] == "header":
        return "rejected" if decode_checked(case[1]) is None else "decoded"
    return _check_round_trip(case)


def derive_decode(case: tuple, rng: random.Random) -> tuple:
    if case[0] == "roundtrip":
        return (*case[:4], fs.random_mutations(rng))
    raw = case[1].SerializeToString() if case[0] == "header" else case[1]
    return ("bytes", fs.derive_bytes(raw, rng))


def decode_cases() -> st.SearchStrategy:
    header = st.tuples(st.just("header"), fs.tensor_messages())
    shapes = st.lists(st.integers(0, 6), max_size=4)
    round_trip = st.tuples(
        st.just("roundtrip"),
        shapes.flatmap(lambda shape: fs.torch_tensors(fs.ALL_DTYPES, shape)),
        st.sampled_from(fs.CODEC_IDS),
        st.sampled_from((codec.MIN_BLOCK_SIZE, 16, codec.DEFAULT_BLOCK_SIZE, 1000)),
        st.one_of(st.just([]), st.lists(fs._mutation, min_size=1, max_size=4)),
    )
    return st.one_of(header, round_trip)


def decode_corpus() -> list:
    return [
        # a zero-element tensor whose other dimensions overflow torch's stride computation
        ("header", pb.Tensor(dtype="float32", shape=[0, (1 << 63) - 1, (1 << 63) - 1])),
        ("header", pb.Tensor(dtype="int64", shape=[1 << 62, 0, 4])),
        (
            "header",
            pb.Tensor(dtype="float32", shape=[4], codec=3, block_size=8, data=b"\1" * 4, scales=b"\0\0\xc0\x7f"),
        ),
        # a scalar (0-dim) tensor with each codec: WireTensor.encode sends scalars as one part
        ("roundtrip", torch.tensor(1.5), pb.CODEC_NONE, 256, []),
        ("roundtrip", torch.tensor(1.5), pb.CODEC_FP16, 256, []),
        ("roundtrip", torch.tensor(7, dtype=torch.int64), pb.CODEC_NONE, 256, []),
    ]


# ---- parse ----

MESSAGE_TYPES = (
    pb.ForwardRequest,
    pb.BackwardRequest,
    pb.InfoRequest,
    pb.StateRequest,
    pb.PartialRequest,
    pb.ContributionsRequest,
    pb.LedgerRequest,
    pb.Chunk,
    pb.Tensor,
    pb.ForwardResponse,
    pb.BackwardResponse,
    pb.InfoResponse,
    pb.ContributionsResponse,
)
BY_NAME = {cls.__name__: cls for cls in MESSAGE_TYPES}
_F = FieldDescriptor
SCALARS = {
    _F.TYPE_INT32: st.integers(*fs.INT32),
    _F.TYPE_INT64: st.integers(*fs.INT64),
    _F.TYPE_UINT64: st.integers(0, (1 << 64) - 1),
    _F.TYPE_BOOL: st.booleans(),
    _F.TYPE_DOUBLE: st.floats(),
    _F.TYPE_STRING: st.text(max_size=24),
    _F.TYPE_BYTES: st.binary(max_size=64),
    _F.TYPE_ENUM: fs.CODEC_VALUES,
}


@st.composite
def proto_messages(draw, cls: type, depth: int = 0):
    """A message of `cls` with random values in random fields (nested messages one level deep)."""
    message = cls()
    for f in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if f.type == _F.TYPE_MESSAGE:
            if depth >= 2:
                continue
            sub = BY_NAME[f.message_type.name]
            items = draw(st.lists(proto_messages(sub, depth + 1), max_size=3)) if f.is_repeated else None
            if items is None:
                getattr(message, f.name).CopyFrom(draw(proto_messages(sub, depth + 1)))
            else:
                getattr(message, f.name).extend(items)
        elif f.is_repeated:
            getattr(message, f.name).extend(draw(st.lists(SCALARS[f.type], max_size=6)))
        else:
            setattr(message, f.name, draw(SCALARS[f.type]))
    return message


BY_NAME["Contribution"] = pb.Contribution


def parse_cases() -> st.SearchStrategy:
    names = st.sampled_from(sorted(n for n in BY_NAME if n != "Contribution"))
    valid = names.flatmap(
        lambda n: st.tuples(st.just(n), fs.mutated(proto_messages(BY_NAME[n]).map(lambda m: m.SerializeToString())))
    )
    random_raw = st.tuples(names, st.binary(max_size=512))
    groups = st.tuples(names, st.integers(1, 20_000).map(lambda d: b"\x7b" * d + b"\x7c" * d))
    return st.one_of(valid, random_raw, groups)


def check_parse(case: tuple) -> str:
    name, raw = case
    cls = BY_NAME[name]
    try:
        message = messages.parse(cls, raw)
    except WireError:
        return "rejected"
    again = messages.parse(cls, message.SerializeToString())
    expect(again == message, f"{name} does not survive serialize and parse")
    return "parsed"


def derive_parse(case: tuple, rng: random.Random) -> tuple:
    return (case[0], fs.derive_bytes(case[1], rng))


def parse_corpus() -> list:
    return [("ForwardRequest", b"\x7b" * 5000 + b"\x7c" * 5000), ("Chunk", b"\x1a\xff\xff\xff\xff\x0f")]


TARGETS = (
    Target("decode", decode_cases, check_decode, weight=22, corpus=decode_corpus, fanout=4, derive=derive_decode),
    Target("parse", parse_cases, check_parse, weight=14, corpus=parse_corpus, fanout=4, derive=derive_parse),
)
