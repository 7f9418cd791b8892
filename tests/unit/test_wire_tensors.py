"""WireTensor parts and the streamed message framing."""

import pytest
import torch

from swarm.wire import stream
from swarm.wire.codec import WireError
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor, split_samples

CODECS = [pb.CODEC_NONE, pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT8_BLOCK]


def test_canonical_split():
    assert split_samples(10, 1 << 20, part_bytes=1 << 20) == [1] * 10
    assert split_samples(10, 300_000, part_bytes=1 << 20) == [3, 3, 3, 1]
    assert split_samples(5, 10) == [5]
    assert split_samples(0, 10) == [0]


@pytest.mark.parametrize("codec_id", CODECS)
def test_parts_round_trip_and_resplit(codec_id):
    x = torch.randn(37, 50_000)
    wire = WireTensor.encode(x, codec_id)
    assert len(wire.parts) > 1 and sum(p.samples for p in wire.parts) == 37
    whole = WireTensor.encode(x, codec_id, [37]).decode()
    assert torch.equal(wire.decode(), whole) or codec_id == pb.CODEC_INT8_BLOCK  # 8-bit blocks differ by part
    assert torch.allclose(wire.decode(), x, atol=0.1)
    for counts in ([37], [1] * 37, [10, 27]):
        again = wire.resplit(counts)
        assert [p.samples for p in again.parts] == counts
        assert torch.allclose(again.decode(), wire.decode(), atol=0.05)
    proto = wire.to_proto()
    assert torch.allclose(WireTensor.from_proto(proto).decode(), wire.decode(), atol=0.05)


def test_resplit_of_raw_parts_does_not_decode():
    wire = WireTensor.encode(torch.arange(12.0).view(6, 2), pb.CODEC_NONE, [6])
    parts = wire.resplit([2, 4]).parts
    assert isinstance(parts[0].data, memoryview) and len(parts[1].data) == 4 * 2 * 4


@pytest.mark.parametrize("codec_id", [pb.CODEC_NONE, pb.CODEC_INT8_BLOCK])
def test_streamed_request_framing(codec_id):
    x = WireTensor.encode(torch.randn(8, 100_000), codec_id)
    g = WireTensor.encode(torch.randn(8, 100_000), codec_id)
    header = pb.BackwardRequest(request_id="r", run_id="run", stage=1)
    messages = stream.request_messages(header, {"input": x, "grad_output": g})
    first = pb.Chunk.FromString(messages[0])
    parsed = pb.BackwardRequest.FromString(first.header)
    assert list(parsed.input.shape) == [8, 100_000] and parsed.input.data == b""
    per_part = 4 if codec_id == pb.CODEC_INT8_BLOCK else 2
    assert len(messages) == 1 + per_part * len(first.parts) and sum(first.parts) == 8


def test_assemble_response_checks_counts():
    out = WireTensor.encode(torch.randn(4, 10), pb.CODEC_NONE, [2, 2])
    response = pb.ForwardResponse(request_id="r")
    response.output.dtype, response.output.codec = out.dtype, out.codec
    response.output.shape[:] = out.shape
    trailing = {stream.RESPONSE_KEY: response.SerializeToString(), stream.PARTS_KEY: "2,2"}
    raw = [bytes(p.data) for p in out.parts]
    _, got = stream.assemble_response(pb.ForwardResponse, raw, trailing)
    assert torch.equal(got.decode(), out.decode())
    with pytest.raises(WireError, match="buffers"):
        stream.assemble_response(pb.ForwardResponse, raw[:1], trailing)
    with pytest.raises(WireError, match="trailing"):
        stream.assemble_response(pb.ForwardResponse, raw, {})
