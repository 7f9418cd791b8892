"""Lying peers: the comparison of answers, the debug liar, and the stage's gradient-norm outlier rule."""

import math

import torch

from swarm.core.debug import LiePlan
from swarm.peer.agreement import OUTLIER_FACTOR, agree, contributions_response, gradient_outliers, snapshot_of
from swarm.peer.executor.updates import HeldSnapshot
from swarm.policy.ledger import Held
from swarm.trainer.honesty import answer, default_tolerance, digest, relative_error
from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor


def test_relative_error_tells_rounding_from_lies():
    torch.manual_seed(0)
    x = torch.randn(4, 32, 32)
    assert relative_error(x, x.clone()) == 0.0
    rounded = WireTensor.encode(x, pb.CODEC_INT8_BLOCK).decode()
    assert relative_error(x, rounded) < default_tolerance(pb.CODEC_INT8_BLOCK, exact=True)
    lie = LiePlan("outputs", 0.5).perturb(x, step=0)
    assert relative_error(x, lie) > 0.4 > default_tolerance(pb.CODEC_INT8_BLOCK, exact=False)
    assert relative_error(x, x[:2]) == math.inf  # another shape is another answer
    assert digest(x) == digest(x.clone()) != digest(lie)


def test_the_liar_lies_only_when_told():
    x = torch.randn(3, 5)
    assert LiePlan("outputs", 0.5, from_step=3).perturb(x, step=2) is x
    assert LiePlan("gradients", 0.5).perturb(x, step=9) is x  # lies about gradients, not outputs
    assert torch.equal(LiePlan("outputs").perturb(torch.arange(4), 5), torch.arange(4))  # token ids


def test_answer_is_the_output_and_the_last_stages_loss():
    out = WireTensor.encode(torch.ones(2, 3), pb.CODEC_NONE)
    assert answer("forward", pb.ForwardResponse(), out).shape == (6,)
    last = answer("backward", pb.BackwardResponse(loss=2.5), out)
    assert last.shape == (7,) and float(last[-1]) == 2.5
    assert answer("backward", pb.BackwardResponse(), None) is None


def snap(norm: float, samples: int = 4, frozen: bool = True, cid: str = "t0/5/0") -> HeldSnapshot:
    return HeldSnapshot(5, frozen, 0, {cid: Held(samples, 0)}, 5, norm)


def test_an_outlier_gradient_is_left_out_of_the_update():
    lists = {"a": snap(1.0, cid="t0/5/0"), "b": snap(1.3, cid="t0/5/4"), "c": snap(40.0, cid="t0/5/8")}
    assert set(gradient_outliers(lists)) == {"c"}
    agreement = agree(5, lists)
    assert [p for p, _ in agreement.members] == ["a", "b"] and agreement.samples == 8
    assert not agreement.ready(12)  # its samples must be replayed on its mates first
    assert agreement.outliers["c"] > OUTLIER_FACTOR


def test_the_outlier_rule_spares_honest_noise_and_needs_three():
    assert gradient_outliers({"a": snap(1.0), "b": snap(3.0), "c": snap(0.6)}) == {}
    assert gradient_outliers({"a": snap(1.0), "b": snap(100.0)}) == {}  # two: no majority
    # a mate with no samples (norm 0) or not frozen does not count as evidence
    assert gradient_outliers({"a": snap(1.0), "b": snap(50.0), "c": snap(0.0, frozen=False)}) == {}


def test_the_norm_travels_in_the_frozen_list():
    s = snap(2.5)
    assert snapshot_of(contributions_response("a", s)).grad_norm == 2.5
