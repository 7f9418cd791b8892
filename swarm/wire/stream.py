"""The streamed form of Forward and Backward (see proto/swarm.proto): the request's large tensors go
part by part, the peer computes each part as it arrives and streams the output parts back, so that
upload, compute and download overlap. Data messages are raw buffers (no protobuf wrapping, no extra
copy); the response's metadata comes last, in the trailing metadata.
"""

from __future__ import annotations

from google.protobuf.message import Message

from swarm.wire.codec import WireError
from swarm.wire.messages import parse
from swarm.wire.protocol import pb
from swarm.wire.tensors import Part, WireTensor, sample_bytes, split_samples

RESPONSE_KEY = "swarm-response-bin"
PARTS_KEY = "swarm-parts"

STREAMED_FIELDS: dict[type, tuple[str, ...]] = {
    pb.ForwardRequest: ("input",),
    pb.BackwardRequest: ("input", "grad_output"),
}
OUTPUT_FIELD: dict[type, str] = {pb.ForwardResponse: "output", pb.BackwardResponse: "grad_input"}


def request_buffers(header: Message, tensors: dict[str, WireTensor], counts: list[int] | None = None) -> list:
    """The streamed form's buffers (header chunk, then each part's data and scales in order), in parts
    of `counts` samples (default: the canonical split), without copying the tensors' data."""
    names = [n for n in STREAMED_FIELDS[type(header)] if n in tensors]
    if counts is None:
        per_sample = max(sample_bytes(t.dtype, t.shape, t.codec) for t in tensors.values())
        counts = split_samples(tensors[names[0]].samples, per_sample)
    split = {n: tensors[n].resplit(counts) for n in names}
    for n in names:
        t, field = split[n], getattr(header, n)
        field.dtype, field.codec, field.block_size = t.dtype, t.codec, t.block_size
        field.shape[:] = t.shape
        field.data, field.scales = b"", b""
    buffers = [pb.Chunk(header=header.SerializeToString(), parts=counts).SerializeToString()]
    for i in range(len(counts)):
        for n in names:
            part = split[n].parts[i]
            buffers.append(part.data)
            if split[n].codec == pb.CODEC_INT8_BLOCK:
                buffers.append(part.scales)
    return buffers


def request_messages(header: Message, tensors: dict[str, WireTensor]) -> list[bytes]:
    """The raw messages of a streamed gRPC request (see `request_buffers`)."""
    return [b if isinstance(b, bytes) else bytes(b) for b in request_buffers(header, tensors)]


def assemble_response(response_cls: type, raw_parts: list[bytes], trailing: dict) -> tuple[Message, WireTensor | None]:
    """The response message and its output tensor (in the parts it arrived in)."""
    if RESPONSE_KEY not in trailing:
        raise WireError("streamed response has no trailing response metadata")
    response = parse(response_cls, trailing[RESPONSE_KEY], f"streamed {response_cls.__name__}")
    name = OUTPUT_FIELD[response_cls]
    if not response.HasField(name):
        if raw_parts:
            raise WireError("streamed response carries data but no output header")
        return response, None
    header = getattr(response, name)
    counts = [int(c) for c in str(trailing.get(PARTS_KEY, "")).split(",") if c]
    per_part = 2 if header.codec == pb.CODEC_INT8_BLOCK else 1
    if len(raw_parts) != per_part * len(counts) or sum(counts) != (header.shape[0] if header.shape else 1):
        raise WireError(f"streamed response has {len(raw_parts)} buffers for parts {counts[:8]}")
    parts = [
        Part(n, raw_parts[per_part * i], raw_parts[per_part * i + 1] if per_part == 2 else b"")
        for i, n in enumerate(counts)
    ]
    wire = WireTensor(header.dtype, tuple(int(s) for s in header.shape), header.codec, header.block_size, parts)
    return response, wire
