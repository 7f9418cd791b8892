"""A backward sent back to the peer that ran its forward leaves its input out when that peer keeps the
forward's activations (ForwardResponse.kept_token, BackwardRequest.kept_token): the same gradients as
with the input, over gRPC and over the lane, unary and streamed; a peer that no longer holds them
answers NOT_FOUND with nothing accumulated, and the trainer's router sends the input then, no ban;
malformed requests are refused."""

import asyncio
import threading
import time

import grpc
import pytest
import torch

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.core.errors import InputNotKept
from swarm.core.states import PeerState
from swarm.peer.executor import StageExecutor
from swarm.peer.lane import LaneService
from swarm.peer.server import StageService, start_server
from swarm.peer.serving import Limits, ServingState
from swarm.policy.wiring import PeerLoad, Wiring
from swarm.trainer.config import TrainerConfig
from swarm.trainer.report import Stats
from swarm.trainer.router import Router, _same_parts
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.wire import stream
from swarm.wire.lane import STREAMED
from swarm.wire.messages import parse
from swarm.wire.pool import ClientPool
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor

SPEC = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 3, "n_heads": 2, "d_ff": 32}
N = 3


def middle(budget_mb: float = 8, stage: int = 1) -> tuple[StageService, StageExecutor]:
    """The online service of `stage` of 3 at step 0, every one from the same parameters."""
    torch.manual_seed(0)
    built = build_stage(SPEC, stage, 3)
    executor = StageExecutor(built, OptimConfig(), activation_budget_bytes=int(budget_mb * (1 << 20)))
    serving = ServingState("run", "peer", "0")
    serving.stage, serving.state, serving.executor, serving.schema = stage, PeerState.ONLINE, executor, built.schema
    return StageService(serving, Limits()), executor


def wire(t: torch.Tensor) -> WireTensor:
    return WireTensor.encode(t, pb.CODEC_NONE)


def forward(rid: str, x: torch.Tensor, stage: int = 1):
    return pb.ForwardRequest(request_id=rid, run_id="run", stage=stage, step=0), {"input": wire(x)}


def backward(rid: str, x: torch.Tensor, g: torch.Tensor, token: int = 0, stage: int = 1):
    """A Backward of the forward `f-<rid>`; with `token`, its input left out."""
    req = pb.BackwardRequest(
        request_id=rid, run_id="run", stage=stage, step=0, num_samples=x.shape[0], contribution_id=rid,
        forward_id=f"f-{rid}", kept_token=token,
    )  # fmt: skip
    return req, ({"grad_output": wire(g)} if token else {"input": wire(x), "grad_output": wire(g)})


async def lane_call(lane: LaneService, kind: str, req, tensors: dict, streamed: bool):
    """(status, response or error details, output) of one lane frame; streamed: in parts of at most 2 samples."""
    n = next(iter(tensors.values())).samples if tensors else req.num_samples
    counts = [2] * (n // 2) + [n % 2] * (n % 2) if streamed else [n]
    buffers = stream.request_buffers(req, tensors, counts)
    status, segments, _ = await lane.answer(kind, buffers, STREAMED if streamed else 0, "ipv4:127.0.0.1:1")
    if status:
        return status, bytes(segments[0]).decode(), None
    head = parse(pb.Chunk, segments[0])
    trailing = {stream.RESPONSE_KEY: head.header, stream.PARTS_KEY: ",".join(map(str, head.parts))}
    cls = pb.ForwardResponse if kind == "forward" else pb.BackwardResponse
    response, output = stream.assemble_response(cls, [bytes(s) for s in segments[1:]], trailing)
    return 0, response, None if output is None else output.decode()


def accumulated(ex: StageExecutor):
    return ex.call(ex.take_accumulated).result(timeout=30)


@pytest.mark.parametrize("streamed", [False, True])
def test_a_backward_without_its_input_equals_one_with_it(streamed):
    (svc_a, ex_a), (svc_b, ex_b) = middle(), middle()
    x, g = torch.randn(N, 8, 16), torch.randn(N, 8, 16)

    async def go():
        a, b = LaneService(svc_a), LaneService(svc_b)
        status, fa, out_a = await lane_call(a, "forward", *forward("f-c1", x), streamed)
        assert status == 0 and fa.kept_token != 0
        _, fb, out_b = await lane_call(b, "forward", *forward("f-c1", x), streamed)
        assert torch.equal(out_a, out_b)
        status, ba, gi_a = await lane_call(a, "backward", *backward("c1", x, g, fa.kept_token), streamed)
        assert status == 0, ba
        _, bb, gi_b = await lane_call(b, "backward", *backward("c1", x, g), streamed)
        return gi_a, gi_b

    try:
        gi_a, gi_b = asyncio.run(go())
        assert torch.equal(gi_a, gi_b)
        ga, gb = accumulated(ex_a), accumulated(ex_b)
        assert ga.samples == gb.samples == N
        assert all(torch.equal(p, q) for p, q in zip(ga.grads, gb.grads, strict=True))
        assert ex_a.activations.counters.activation_hits == (2 if streamed else 1)  # a kept graph per part
    finally:
        ex_a.stop()
        ex_b.stop()


def test_a_wrong_token_or_a_dropped_forward_gets_not_found_and_adds_nothing():
    """A wrong token leaves the kept forward for its requester; a forward dropped by an update is gone:
    both get NOT_FOUND with nothing accumulated, and the resend with the input is served."""
    svc, ex = middle()
    x, g = torch.randn(N, 8, 16), torch.randn(N, 8, 16)

    async def go():
        lane = LaneService(svc)
        _, f1, _ = await lane_call(lane, "forward", *forward("f-c1", x), False)
        wrong = await lane_call(lane, "backward", *backward("c1", x, g, f1.kept_token + 1), False)
        right = await lane_call(lane, "backward", *backward("c1", x, g, f1.kept_token), False)  # still kept
        _, f2, _ = await lane_call(lane, "forward", *forward("f-c2", x), False)
        ex.call(ex.activations.clear).result(timeout=30)  # what an update does to every kept forward
        gone = await lane_call(lane, "backward", *backward("c2", x, g, f2.kept_token), False)
        resent = await lane_call(lane, "backward", *backward("c2", x, g), False)  # the trainer's resend
        return wrong, right, gone, resent

    try:
        wrong, right, gone, resent = asyncio.run(go())
        for status, details, _ in (wrong, gone):
            assert status == grpc.StatusCode.NOT_FOUND.value[0], details
            assert "holds no kept forward" in details
        assert right[0] == 0 and resent[0] == 0 and resent[2].shape == (N, 8, 16)
        assert accumulated(ex).samples == 2 * N  # c1 and c2 once each: the refused calls added nothing
        assert ex.activations.counters.activation_hits == 1
    finally:
        ex.stop()


def test_malformed_requests_without_an_input_are_refused():
    svc, ex = middle()
    last_svc, last_ex = middle(stage=2)
    x, g = torch.randn(N, 8, 16), torch.randn(N, 8, 16)

    async def go():
        lane, last = LaneService(svc), LaneService(last_svc)
        _, f, _ = await lane_call(lane, "forward", *forward("f-c1", x), False)
        with_input = backward("c1", x, g)
        with_input[0].kept_token = f.kept_token
        no_forward = backward("c1", x, g, f.kept_token)
        no_forward[0].forward_id = ""
        no_samples = backward("c1", x, g, f.kept_token)
        no_samples[0].num_samples = 0
        on_last, _ = backward("c1", x, g, 7, stage=2)  # the last stage keeps no forward
        on_last.targets.CopyFrom(wire(torch.zeros(N, 8, dtype=torch.long)).to_proto())
        return [
            await lane_call(lane, "backward", *with_input, False),
            await lane_call(lane, "backward", *no_forward, False),
            await lane_call(lane, "backward", *no_samples, False),
            await lane_call(last, "backward", on_last, {}, False),
            await lane_call(lane, "backward", *backward("c1", x, g, f.kept_token), False),  # still served
        ]

    try:
        *refused, served = asyncio.run(go())
        reasons = ["carries it", "forward_id", "num_samples 0", "last stage keeps no forward"]
        for (status, details, _), reason in zip(refused, reasons, strict=True):
            assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and reason in details, details
        assert served[0] == 0 and accumulated(ex).samples == N
    finally:
        ex.stop()
        last_ex.stop()


@pytest.mark.parametrize("lane", [False, True])
@pytest.mark.parametrize("streamed", [False, True])
def test_the_router_sends_the_input_when_the_peer_no_longer_holds_the_forward(lane, streamed):
    """Through a real gRPC server (and lane) on loopback and the trainer's real router: a backward to
    the forward's peer goes without its input; when that peer dropped the forward (an update cleared
    it), its NOT_FOUND makes the router send the input at once: no ban, no failed call, each
    contribution accumulated once."""
    svc, ex = middle()
    x, g = torch.randn(N, 8, 16), torch.randn(N, 8, 16)

    async def go():
        server, port = await start_server(svc, "127.0.0.1", 0, Limits())
        lane_service = LaneService(svc)
        lane_port = await lane_service.start("127.0.0.1", 0)
        pool = ClientPool(lane=lane, **({"stream_threshold": 1024} if streamed else {}))
        address = f"127.0.0.1:{port}"
        if lane:
            pool.get(address).set_lane(lane_port)
        view = SwarmView(None, 3, pool)
        status = PeerStatus(PeerLoad("peer", 1, address), PeerState.ONLINE, last_info_ok=time.monotonic())
        view.peers["peer"] = status
        stats = Stats()
        router = Router(TrainerConfig(run_id="run", stage_wait_s=10), view, pool, Wiring(), stats, 3)
        try:
            calls = []
            for rid, drop in (("c1", False), ("c2", True)):
                f, _, peer = await router.call(1, *forward(f"f-{rid}", x), N, "forward")
                assert f.kept_token and peer.peer_id == "peer"
                if drop:
                    ex.call(ex.activations.clear).result(timeout=30)
                req, tensors = backward(rid, x, g)  # as the trainer holds it: with its input
                kept = (peer.peer_id, int(f.kept_token))
                calls.append(await router.call(1, req, tensors, N, "backward", prefer="peer", kept=kept))
                assert req.kept_token == 0 and "input" in tensors  # the caller's copy is left whole
            return calls, stats, status
        finally:
            await pool.close()
            await lane_service.stop()
            await server.stop(None)

    try:
        calls, stats, status = asyncio.run(go())
        assert all(out is not None and out.samples == N for _, out, _ in calls)
        assert stats.inputs_left_out == 1 and stats.inputs_resent == 1  # c1 answered without it; c2 resent
        assert stats.failed_calls == 0 and stats.retries == 0 and status.load.failures == 0
        assert accumulated(ex).samples == 2 * N
        assert ex.activations.counters.activation_hits == 1  # c2's backward recomputed from the resent input
    finally:
        ex.stop()


def test_backwards_without_inputs_share_a_batch_and_a_missing_forward_fails_alone():
    """Queued backwards on kept forwards run in one batch (a backward at the head of the queue takes the
    queued ones of its kind along, ahead of queued forwards); one whose forward is not here is answered
    InputNotKept, and the others are computed and accumulated as if alone."""
    (_, ex), (_, ref) = middle(), middle()
    xs, g = [torch.randn(N, 8, 16) for _ in range(3)], torch.randn(N, 8, 16)
    try:
        for i, x in enumerate(xs):
            assert ex.forward(x, key=f"f{i}", kept_token=100 + i).result(timeout=30).kept
            ref.forward(x, key=f"f{i}").result(timeout=30)
        gate = threading.Event()
        ex.call(lambda: gate.wait(30))  # holds the compute thread: the backwards queue up behind it
        tokens = [100, 999, 102]  # the second names another forward's token
        futures = [
            ex.backward(None, g, None, f"c{i}", forward_key=f"f{i}", kept_token=t, samples=N)
            for i, t in enumerate(tokens)
        ]
        gate.set()
        with pytest.raises(InputNotKept):
            futures[1].result(timeout=30)
        for i in (0, 2):
            want = ref.backward(xs[i], g, None, f"c{i}", forward_key=f"f{i}").result(timeout=30).grad_input
            assert torch.equal(futures[i].result(timeout=30).grad_input, want)
        got, expected = accumulated(ex), accumulated(ref)
        assert got.samples == expected.samples == 2 * N
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got.grads, expected.grads, strict=True))
        assert ex.activations.counters.activation_hits == 2 and len(ex.activations) == 1  # f1 stays for its owner
    finally:
        ex.stop()
        ref.stop()


def test_the_input_is_left_out_only_when_the_backward_goes_in_the_forwards_parts():
    """The peer keeps a forward's activations by part (unary, or each part of a streamed request): a
    backward without its input in other parts could never find them (a wasted round trip each)."""
    small, large = torch.randn(2, 8, 16), torch.randn(64, 64, 128)  # 1 KiB and 2 MiB of float32
    tokens = torch.zeros(64, 64, dtype=torch.long)
    assert _same_parts({"input": wire(small), "grad_output": wire(small)}, 2 << 20)  # both unary
    assert _same_parts({"input": wire(large), "grad_output": wire(large)}, 1 << 20)  # both streamed alike
    assert not _same_parts({"input": wire(tokens), "grad_output": wire(large)}, 1 << 20)  # unary, streamed
    half = WireTensor.encode(large, pb.CODEC_FP16)  # streamed in fewer, larger parts than float32
    assert not _same_parts({"input": half, "grad_output": wire(large)}, 64 << 10)
    assert not _same_parts({"input": wire(small)}, 2 << 20)  # the last stage: no grad_output
