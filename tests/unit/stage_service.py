"""A real last-stage StageService on a tiny GPT, and the requests the unit tests send it (no network:
the service's handlers are called with serialized messages and a stand-in gRPC context)."""

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


class Context:
    """The part of a gRPC servicer context the handlers use."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code, details="", trailing_metadata=()):
        raise AssertionError(f"{code}: {details}")


def last_stage(predict_params: bool = False) -> tuple[StageService, StageExecutor]:
    """The service of stage 1 of 2, online at step 0, and its executor (the caller stops it)."""
    built = build_stage(SPEC, 1, 2)
    executor = StageExecutor(built, OptimConfig(), max_batch_samples=16, predict_params=predict_params)
    serving = ServingState("run", "peer", "0")
    serving.stage, serving.state, serving.executor, serving.schema = 1, PeerState.ONLINE, executor, built.schema
    return StageService(serving, Limits()), executor


def backward_request(n: int, step: int = 0, cid: str = "t0/0/0") -> bytes:
    """A serialized Backward of `n` random samples for `step`, under contribution id `cid`."""
    request = pb.BackwardRequest(request_id=cid, run_id="run", stage=1, step=step, num_samples=n, contribution_id=cid)
    request.input.CopyFrom(codec.tensor_to_proto(torch.randn(n, SPEC["seq_len"], SPEC["d_model"])))
    request.targets.CopyFrom(codec.tensor_to_proto(torch.randint(0, SPEC["vocab_size"], (n, SPEC["seq_len"]))))
    return request.SerializeToString()
