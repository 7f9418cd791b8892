"""A request for a step past the peer's (async: computed at predicted parameters) tells the peer, so
that it re-reads its mates' counts and fetches their partial sums for the run-ahead microbatches
that follow (swarm.peer.daemon, swarm.peer.partials)."""

import asyncio

import pytest
import torch

from swarm.core.states import PeerState
from swarm.peer.executor import StageExecutor
from swarm.peer.server import StageService
from swarm.peer.serving import Limits, ServingState
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.wire import codec
from swarm.wire.protocol import pb

SPEC = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


class _Context:
    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code, details="", trailing_metadata=()):
        raise AssertionError(f"{code}: {details}")


def _backward(n: int, step: int, cid: str) -> bytes:
    request = pb.BackwardRequest(request_id=cid, run_id="run", stage=1, step=step, num_samples=n, contribution_id=cid)
    request.input.CopyFrom(codec.tensor_to_proto(torch.randn(n, SPEC["seq_len"], SPEC["d_model"])))
    request.targets.CopyFrom(codec.tensor_to_proto(torch.randint(0, SPEC["vocab_size"], (n, SPEC["seq_len"]))))
    return request.SerializeToString()


@pytest.mark.timeout(60)
def test_a_request_for_a_later_step_tells_the_peer_a_prediction_is_wanted():
    built = build_stage(SPEC, 1, 2)
    executor = StageExecutor(built, OptimConfig(), max_batch_samples=16, predict_params=True)
    serving = ServingState("run", "peer", "0")
    serving.stage, serving.state, serving.executor, serving.schema = 1, PeerState.ONLINE, executor, built.schema
    service = StageService(serving, Limits())
    told: list[int] = []
    serving.on_run_ahead = lambda: told.append(executor.step)

    async def go():
        await service.backward(_backward(2, 0, "t0/0/0"), _Context())  # for the peer's own step: nothing
        assert told == []
        await service.backward(_backward(2, 1, "t0/1/0"), _Context())  # one step ahead: told, at step 0
        assert told == [0]

    try:
        asyncio.run(go())
    finally:
        executor.stop()
