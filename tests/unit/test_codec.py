"""Tensor codec round trips for every dtype and codec, the 8-bit error bound, malformed messages."""

import pytest
import torch

from swarm.wire import codec
from swarm.wire.codec import WireError
from swarm.wire.protocol import pb

ALL_DTYPES = list(codec.DTYPES.values())
CODECS = [pb.CODEC_NONE, pb.CODEC_FP16, pb.CODEC_BF16, pb.CODEC_INT8_BLOCK]


def make(dtype: torch.dtype, shape=(3, 5, 7)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("codec_id", CODECS, ids=lambda c: codec.CODEC_LABELS[c])
def test_round_trip_every_dtype_and_codec(dtype, codec_id):
    x = make(dtype)
    msg = codec.tensor_to_proto(x, codec_id)
    y = codec.decode(pb.Tensor.FromString(msg.SerializeToString()))
    assert y.dtype == x.dtype and y.shape == x.shape
    if not dtype.is_floating_point:
        assert msg.codec == pb.CODEC_NONE  # integers always travel raw
        assert torch.equal(x, y)
    elif codec_id == pb.CODEC_NONE:
        assert torch.equal(x, y)
    elif codec_id == pb.CODEC_FP16:
        assert torch.allclose(x.double(), y.double(), rtol=1e-3, atol=1e-3)
    elif codec_id == pb.CODEC_BF16:
        assert torch.allclose(x.double(), y.double(), rtol=1e-2, atol=1e-2)
    else:
        assert torch.isfinite(y).all()


@pytest.mark.parametrize("block", [8, 64, 256, 4096])
@pytest.mark.parametrize("n", [1, 255, 256, 257, 10_000])
def test_int8_blockwise_error_bound(block, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * torch.logspace(-3, 3, n)
    enc = codec.encode(x, pb.CODEC_INT8_BLOCK, block_size=block)
    y = codec.decode(codec.to_proto(enc))
    padded = torch.zeros(((n + block - 1) // block) * block)
    padded[:n] = x
    absmax = padded.view(-1, block).abs().amax(dim=1)
    bound = (absmax / 254.0).repeat_interleave(block)[:n] * (1 + 1e-5) + 1e-12
    assert ((x - y).abs() <= bound).all(), "|x - decode(encode(x))| must be <= absmax(block) / 254"
    assert len(enc.data) == n and len(enc.scales) == 4 * ((n + block - 1) // block)


def test_int8_bytes_ratio():
    x = torch.randn(1 << 16)
    msg = codec.tensor_to_proto(x, pb.CODEC_INT8_BLOCK)
    assert codec.encoded_nbytes(msg) / (x.numel() * 4) <= 0.27


def test_zero_and_empty_tensors():
    for codec_id in CODECS:
        z = torch.zeros(4, 4)
        assert torch.equal(codec.decode(codec.tensor_to_proto(z, codec_id)), z)
        e = torch.zeros(0, 3)
        assert codec.decode(codec.tensor_to_proto(e, codec_id)).shape == (0, 3)


def _msg(**kw) -> pb.Tensor:
    base = dict(dtype="float32", shape=[2, 2], codec=pb.CODEC_NONE, data=b"\0" * 16)
    base.update(kw)
    return pb.Tensor(**base)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(dtype="complex64"), "unknown dtype"),
        (dict(codec=42), "unknown codec"),
        (dict(data=b"\0" * 15), "needs 16"),
        (dict(shape=[-1, 2]), "negative"),
        (dict(shape=[1] * 9, data=b"\0" * 4), "dimensions"),
        (dict(codec=pb.CODEC_FP16, data=b"\0" * 4), "needs 8"),
        (dict(codec=pb.CODEC_INT8_BLOCK, block_size=64, data=b"\0" * 4, scales=b""), "scales"),
        (dict(codec=pb.CODEC_INT8_BLOCK, block_size=3, data=b"\0" * 4, scales=b"\0" * 4), "block size"),
        (dict(dtype="int64", codec=pb.CODEC_FP16, data=b"\0" * 8), "float tensors"),
    ],
)
def test_malformed_tensor_messages_raise_clear_errors(bad, match):
    with pytest.raises(WireError, match=match):
        codec.decode(_msg(**bad))


def test_nan_scales_rejected():
    scales = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(WireError, match="NaN"):
        codec.decode(_msg(codec=pb.CODEC_INT8_BLOCK, block_size=8, data=b"\0" * 4, scales=scales))


def test_numel_limit():
    with pytest.raises(WireError, match="limit"):
        codec.decode(_msg(shape=[1 << 20, 1 << 20], data=b""), max_numel=1 << 30)


@pytest.mark.parametrize("codec_id", [pb.CODEC_NONE, pb.CODEC_FP16, pb.CODEC_INT8_BLOCK], ids=str)
def test_empty_tensor_with_huge_dimensions_is_refused(codec_id):
    # found by the fuzzer (docs/FUZZING.md): 0 elements passed the limit, then torch.empty raised
    # "Stride calculation overflowed" (a RuntimeError, INTERNAL through a handler)
    huge = (1 << 63) - 1
    msg = _msg(shape=[0, huge, huge], codec=codec_id, data=b"", block_size=8, scales=b"\0" * 4)
    with pytest.raises(WireError, match="limit"):
        codec.decode(msg, max_numel=1 << 16)
    assert codec.decode(_msg(shape=[0, 256, 256], data=b""), max_numel=1 << 16).shape == (0, 256, 256)


@pytest.mark.parametrize("codec_id", CODECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int16, torch.bool], ids=str)
def test_scalars_and_strided_empty_tensors_encode(codec_id, dtype):
    # found by the fuzzer: view(torch.uint8) of a 0-dim tensor (or an empty one with strides (1, 0))
    # raised RuntimeError instead of encoding it
    scalar = torch.tensor(1.5).to(dtype)
    y = codec.decode(codec.to_proto(codec.encode(scalar, codec_id)))
    assert y.shape == () and y.dtype == dtype and float(y) == pytest.approx(float(scalar), rel=0.01)
    empty = torch.randn(0, 1, dtype=torch.float64).to(dtype)
    assert codec.decode(codec.to_proto(codec.encode(empty, codec_id))).shape == (0, 1)
