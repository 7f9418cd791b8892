"""Streamed messages: header + buffer chunks, reassembled and checked."""

import pytest
import torch

from swarm.wire import codec, messages
from swarm.wire.codec import WireError
from swarm.wire.protocol import pb


def request(n: int = 5000) -> pb.BackwardRequest:
    m = pb.BackwardRequest(request_id="r1", run_id="run", stage=1, num_samples=2)
    codec.tensor_to_proto(torch.randn(2, n), pb.CODEC_INT8_BLOCK, m.input)
    codec.tensor_to_proto(torch.randn(2, n), pb.CODEC_FP16, m.grad_output)
    return m


@pytest.mark.parametrize("chunk", [7, 1000, 1 << 20])
def test_stream_round_trip(chunk):
    m = request()
    chunks = list(messages.to_chunks(m, chunk))
    got = messages.from_chunks([c.SerializeToString() for c in chunks], pb.BackwardRequest, 1 << 24)
    assert got.message.request_id == "r1"
    for name in ("input", "grad_output"):
        assert torch.equal(got.tensor(name, 1 << 20), messages.Received(m).tensor(name, 1 << 20))
    assert got.tensor("targets", 10) is None


def test_truncated_stream():
    chunks = list(messages.to_chunks(request(), 1000))
    with pytest.raises(WireError, match="ended after"):
        messages.from_chunks(chunks[:-1], pb.BackwardRequest, 1 << 24)


def test_stream_over_limit():
    chunks = list(messages.to_chunks(request(), 1000))
    with pytest.raises(WireError, match="limit"):
        messages.from_chunks(chunks, pb.BackwardRequest, 100)


def test_stream_extra_data_and_missing_header():
    chunks = list(messages.to_chunks(request(), 1000))
    with pytest.raises(WireError, match="more data"):
        messages.from_chunks([*chunks, pb.Chunk(data=b"x")], pb.BackwardRequest, 1 << 24)
    with pytest.raises(WireError, match="header"):
        messages.from_chunks(chunks[1:], pb.BackwardRequest, 1 << 24)
    with pytest.raises(WireError, match="malformed"):
        messages.from_chunks([b"\xff\xff\xff garbage"], pb.BackwardRequest, 1 << 24)
