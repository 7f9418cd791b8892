"""Bad input to a peer's Forward and Backward gets a clear gRPC error; the peer keeps serving."""

import asyncio

import grpc
import pytest
import torch

from swarm.training.config import OptimConfig
from swarm.wire import codec, stream
from swarm.wire.options import channel_options
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor
from tests.integration.helpers import TINY_GPT, info, run_args

D, T = TINY_GPT["d_model"], TINY_GPT["seq_len"]


def tensor(t: torch.Tensor, codec_id=pb.CODEC_NONE) -> pb.Tensor:
    return codec.tensor_to_proto(t, codec_id)


@pytest.fixture(scope="module")
def two_stage_swarm(tmp_path_factory):
    from swarm.local import LocalOptions, LocalSwarm
    from tests.integration.helpers import assert_all_reaped

    swarm = LocalSwarm(
        LocalOptions(
            stages=2,
            stage_layout=[1, 1],
            run_args=run_args(),
            peer_args=["--max-message-mb", "1"],
            log_dir=str(tmp_path_factory.mktemp("bad-input")),
        )
    )
    try:
        swarm.start()
        yield swarm
    finally:
        pgids = [p.pgid for p in swarm.all_processes()]
        swarm.stop()
        assert_all_reaped(pgids)


def call(address: str, method: str, payload, stream: bool = False):
    """Send raw bytes (or a list of raw chunks) and return (status code, details)."""

    async def go():
        async with grpc.aio.insecure_channel(address, options=channel_options(64 << 20)) as channel:
            try:
                if stream:
                    fn = channel.stream_stream(f"/swarm.Stage/{method}")
                    async for _ in fn(iter(payload), timeout=20):
                        pass
                else:
                    await channel.unary_unary(f"/swarm.Stage/{method}")(payload, timeout=20)
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details() or ""

    return asyncio.run(go())


def fwd(swarm_run_id: str, stage: int, x: pb.Tensor | None, **kw) -> bytes:
    req = pb.ForwardRequest(request_id="bad", run_id=swarm_run_id, stage=stage, **kw)
    if x is not None:
        req.input.CopyFrom(x)
    return req.SerializeToString()


def cases(run_id: str):
    good_hidden = torch.randn(2, T, D)
    truncated = tensor(good_hidden)
    truncated.data = truncated.data[:-7]
    unknown_codec = tensor(good_hidden)
    unknown_codec.codec = 17
    nan = good_hidden.clone()
    nan[0, 0, 0] = float("nan")
    targets = tensor(torch.randint(0, 256, (2, T)))
    yield "wrong shape", fwd(run_id, 1, tensor(torch.randn(2, T, D + 1)), targets=targets), "INVALID_ARGUMENT", "shape"
    yield (
        "wrong dtype",
        fwd(run_id, 1, tensor(torch.randint(0, 5, (2, T, D))), targets=targets),
        "INVALID_ARGUMENT",
        "dtype",
    )
    yield "NaN input", fwd(run_id, 1, tensor(nan), targets=targets), "INVALID_ARGUMENT", "NaN"
    yield "truncated buffer", fwd(run_id, 1, truncated, targets=targets), "INVALID_ARGUMENT", "buffer holds"
    yield "unknown codec", fwd(run_id, 1, unknown_codec, targets=targets), "INVALID_ARGUMENT", "unknown codec"
    yield "garbage bytes", b"\x12\xff\xfe garbage \x00\x01", "INVALID_ARGUMENT", "malformed"
    yield "no input", fwd(run_id, 1, None, targets=targets), "INVALID_ARGUMENT", "no input"
    yield "no targets on last stage", fwd(run_id, 1, tensor(good_hidden)), "INVALID_ARGUMENT", "targets"
    yield "token id out of range", fwd(run_id, 0, tensor(torch.full((2, T), 999))), "INVALID_ARGUMENT", "outside"
    yield (
        "too long sequence",
        fwd(run_id, 0, tensor(torch.zeros(2, T + 1, dtype=torch.long))),
        "INVALID_ARGUMENT",
        "dim 1",
    )
    yield "wrong run", fwd("other-run", 1, tensor(good_hidden), targets=targets), "FAILED_PRECONDITION", "run id"
    yield "wrong stage", fwd(run_id, 0, tensor(good_hidden)), "FAILED_PRECONDITION", "stage"
    big = fwd(run_id, 1, tensor(torch.randn(8, T, D * 40)), targets=targets)
    yield "oversize message", big, "RESOURCE_EXHAUSTED", ""


def test_bad_forward_requests_get_clear_errors_and_peer_keeps_serving(two_stage_swarm):
    swarm = two_stage_swarm
    by_stage = {p.ready["stage"]: p.ready["address"] for p in swarm.peers}
    for name, payload, code, needle in cases(swarm.run_id):
        stage = 0 if name in ("token id out of range", "too long sequence") else 1
        got_code, details = call(by_stage[stage], "Forward", payload)
        assert got_code.name == code, f"{name}: {got_code} {details}"
        assert needle.lower() in details.lower(), f"{name}: {details!r}"
    # still serving, and a valid request works
    x = tensor(torch.randn(2, T, D))
    req = pb.ForwardRequest(request_id="ok", run_id=swarm.run_id, stage=1)
    req.input.CopyFrom(x)
    req.targets.CopyFrom(tensor(torch.randint(0, 256, (2, T))))
    assert call(by_stage[1], "Forward", req.SerializeToString())[0] == grpc.StatusCode.OK
    assert all(p.alive() for p in swarm.peers)
    assert info(by_stage[1]).state == "online"


def test_bad_backward_and_stream_requests(two_stage_swarm):
    swarm = two_stage_swarm
    addr0 = next(p.ready["address"] for p in swarm.peers if p.ready["stage"] == 0)
    tokens = tensor(torch.randint(0, 256, (2, T)))
    grad_nan = torch.randn(2, T, D)
    grad_nan[1, 2, 3] = float("inf")
    for grad, needle in (
        (grad_nan, "NaN or infinity"),
        (torch.randn(3, T, D), "batch"),
        (torch.randn(2, T, D + 2), "shape"),
    ):
        req = pb.BackwardRequest(request_id="b", run_id=swarm.run_id, stage=0, num_samples=2)
        req.input.CopyFrom(tokens)
        req.grad_output.CopyFrom(tensor(grad))
        code, details = call(addr0, "Backward", req.SerializeToString())
        assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    assert info(addr0).samples_accumulated == 0  # nothing bad was accumulated
    # streams: truncated, no header, parts that do not add up, extra messages, oversize
    req = pb.BackwardRequest(request_id="s", run_id=swarm.run_id, stage=0, num_samples=2)
    wires = {
        "input": WireTensor.encode(torch.randint(0, 256, (2, T)), pb.CODEC_NONE),
        "grad_output": WireTensor.encode(torch.randn(2, T, D), pb.CODEC_NONE),
    }
    msgs = stream.request_messages(req, wires)
    code, details = call(addr0, "BackwardStream", msgs[:-1], stream=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "ended before" in details, details
    code, details = call(addr0, "BackwardStream", msgs[1:], stream=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "header" in details, (code, details)
    bad_parts = pb.Chunk.FromString(msgs[0])
    bad_parts.parts[:] = [5]
    code, details = call(addr0, "BackwardStream", [bad_parts.SerializeToString(), *msgs[1:]], stream=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "add up" in details, details
    code, details = call(addr0, "BackwardStream", [msgs[0], b"\0" * (2 << 20)], stream=True)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert info(addr0).samples_accumulated == 0  # nothing from the broken streams was accumulated
    # trailing junk is noticed after the parts were computed: their gradient counts once...
    code, details = call(addr0, "BackwardStream", [*msgs, b"extra"], stream=True)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "more messages" in details, details
    # ...and the retry of the same request (same id) is recognized, not counted twice
    code, details = call(addr0, "BackwardStream", msgs, stream=True)
    assert code == grpc.StatusCode.OK, details
    assert info(addr0).samples_accumulated == 2


def test_partial_gradient_requests(two_stage_swarm):
    """GetPartialGradient (async look-ahead): bad requests get clear errors, a good one the peer's
    sum for its pending update, which the peer-side check accepts."""
    from swarm.peer.executor import StageExecutor
    from swarm.peer.partials import decode_partial
    from swarm.training.models import build_stage
    from swarm.wire.blob import receive_blob

    swarm = two_stage_swarm
    addr0 = next(p.ready["address"] for p in swarm.peers if p.ready["stage"] == 0)

    def get(payload: bytes):
        async def go():
            async with grpc.aio.insecure_channel(addr0, options=channel_options(64 << 20)) as channel:
                stream = channel.unary_stream("/swarm.Stage/GetPartialGradient")(payload, timeout=20)
                try:
                    return grpc.StatusCode.OK, await receive_blob(stream, 64 << 20, "partial gradient")
                except grpc.aio.AioRpcError as e:
                    return e.code(), e.details() or ""

        return asyncio.run(go())

    step = info(addr0).step
    for payload, code, needle in (
        (b"\x12\xff\xfe garbage", grpc.StatusCode.INVALID_ARGUMENT, "malformed"),
        (pb.PartialRequest(run_id="other", stage=0, step=step), grpc.StatusCode.FAILED_PRECONDITION, "run"),
        (pb.PartialRequest(run_id=swarm.run_id, stage=1, step=step), grpc.StatusCode.FAILED_PRECONDITION, "stage"),
        (pb.PartialRequest(run_id=swarm.run_id, stage=0, step=step + 5), grpc.StatusCode.FAILED_PRECONDITION, "not"),
    ):
        raw = payload if isinstance(payload, bytes) else payload.SerializeToString()
        got, details = get(raw)
        assert got == code and needle in details, (got, details)
    # a good request: the sum of what the peer holds for its pending update
    got, (header, data) = get(pb.PartialRequest(run_id=swarm.run_id, stage=0, step=step).SerializeToString())
    assert got == grpc.StatusCode.OK and header["step"] == step
    ex = StageExecutor(build_stage(TINY_GPT, 0, 2), OptimConfig())
    try:
        partial = decode_partial(header, data, ex.params, step)
    finally:
        ex.stop()
    assert partial.samples == info(addr0).samples_accumulated
    assert all(p.alive() for p in swarm.peers) and info(addr0).state == "online"
