"""Catching up with a mate's update: a peer's gradient counts once, whether or not it reached the mate."""

import asyncio

import pytest
import torch

from swarm.peer.executor import StageExecutor
from swarm.peer.stepping import StepCoordinator
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.training.state import deserialize, serialize

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


@pytest.fixture
def mates():
    torch.manual_seed(0)
    stage = build_stage(GPT, 1, 2)
    a = StageExecutor(stage, OptimConfig())
    b = StageExecutor(build_stage(GPT, 1, 2), OptimConfig())
    b.module.load_state_dict(a.module.state_dict())
    yield a, b
    a.stop()
    b.stop()


def _accumulate(ex: StageExecutor, n: int, key: str) -> None:
    h, y = torch.randn(n, 8, 16), torch.randint(0, 64, (n, 8))
    ex.backward(h, None, y, key).result(timeout=30)


class _Mates:
    """The peer's side the step coordinator talks to: no live mates, a state download."""

    def __init__(self, peer_id, download):
        self.peer_id, self._download = peer_id, download

    def live_mates(self):
        return []

    async def sync_from_mates(self, preferred=None) -> bool:
        return await self._download(preferred)

    async def refresh_view(self) -> None:
        return None


def _catch_up(behind: StageExecutor, ahead: StageExecutor) -> None:
    """`behind` froze its gradient for update 0, its all-reduce failed, and `ahead` applied update 0."""

    async def download(preferred=None) -> bool:
        state = deserialize(serialize(ahead.call(ahead.state_dict).result(timeout=30)))
        behind.call(lambda: behind.load_state_dict(state)).result(timeout=30)
        return True

    coordinator = StepCoordinator(behind, None, _Mates("peer-b", download), 8, 30.0)
    frozen = behind.call(behind.take_accumulated).result(timeout=30)
    asyncio.run(coordinator._catch_up(frozen))


@pytest.mark.parametrize("b_in_mates_update", [True, False])
def test_catch_up_counts_own_gradient_once(mates, b_in_mates_update):
    a, b = mates
    _accumulate(a, 4, "a0")
    _accumulate(b, 4, "b0")
    a_frozen = a.call(a.take_accumulated).result(timeout=30)
    members = ("peer-a", "peer-b") if b_in_mates_update else ("peer-a",)
    mean = [g / 4 for g in a_frozen.grads]  # which mean does not matter here: only who is in it
    a.call(lambda: a.apply_mean_gradient(mean, 0, members)).result(timeout=30)

    _catch_up(b, a)

    assert b.step == 1 and b.last_update == (0, members)
    assert all(torch.equal(p, q) for p, q in zip(a.params, b.params, strict=True))
    if b_in_mates_update:
        # the mate's round completed with b's gradient: carrying it would count those samples twice
        assert b.samples_accumulated == 0 and b.counters.samples_discarded == 0
    else:
        assert b.samples_accumulated == 4 and b.accumulating_step == 1
