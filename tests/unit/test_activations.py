"""Kept forward activations: a backward on the peer that ran the forward skips the recompute and
gives the same gradients; anything that could make the kept graph wrong (new parameters, another
input, the budget) falls back to recomputing."""

import pytest
import torch

from swarm.peer.executor import StageExecutor
from swarm.peer.executor.activations import ActivationCache
from swarm.policy.wiring import PeerLoad, Wiring
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 3, "n_heads": 2, "d_ff": 32}


def middle(budget_mb: float):
    torch.manual_seed(0)  # every executor of a test starts from the same parameters
    return StageExecutor(build_stage(GPT, 1, 3), OptimConfig(), activation_budget_bytes=int(budget_mb * (1 << 20)))


@pytest.fixture
def pair():
    kept, plain = middle(8), middle(0)
    yield kept, plain
    kept.stop()
    plain.stop()


def run(ex: StageExecutor, x: torch.Tensor, g: torch.Tensor, name: str, forward_key: str):
    out = ex.forward(x, key=name).result(timeout=30).output
    back = ex.backward(x, g, None, f"c-{name}", forward_key=forward_key).result(timeout=30)
    return out, back.grad_input


def test_backward_from_kept_forward_equals_recompute(pair):
    kept, plain = pair
    x, g = torch.randn(3, 8, 16), torch.randn(3, 8, 16)
    out_a, gi_a = run(kept, x, g, "f1", "f1")
    out_b, gi_b = run(plain, x, g, "f1", "f1")
    assert kept.activations.counters.activation_hits == 1 and plain.activations.counters.activation_hits == 0
    assert torch.allclose(out_a, out_b, atol=1e-6) and torch.allclose(gi_a, gi_b, atol=1e-6)
    ga = kept.call(kept.take_accumulated).result(timeout=30)
    gb = plain.call(plain.take_accumulated).result(timeout=30)
    assert ga.samples == gb.samples == 3
    for a, b in zip(ga.grads, gb.grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert len(kept.activations) == 0  # used once, then freed
    counters = kept.counters_dict()
    assert counters["activation_hits"] == 1 and counters["activations_kept"] == 1


def test_batched_forwards_keep_one_graph_each(pair):
    kept, _ = pair
    xs = [torch.randn(2, 8, 16) for _ in range(3)]
    futures = [kept.forward(x, key=f"f{i}") for i, x in enumerate(xs)]
    outs = [f.result(timeout=30).output for f in futures]
    assert all(o.shape == (2, 8, 16) for o in outs)
    assert len(kept.activations) == 3 and kept.activations.nbytes > 0
    for i, x in enumerate(xs):
        kept.backward(x, torch.randn(2, 8, 16), None, f"c{i}", forward_key=f"f{i}").result(timeout=30)
    assert kept.activations.counters.activation_hits == 3 and kept.samples_accumulated == 6


def test_an_update_drops_kept_forwards(pair):
    kept, _ = pair
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    kept.forward(x, key="old").result(timeout=30)
    kept.backward(torch.randn(2, 8, 16), g, None, "other").result(timeout=30)
    kept.call(kept.local_step).result(timeout=30)  # the parameters change
    assert len(kept.activations) == 0 and kept.activations.counters.activations_dropped == 1
    kept.backward(x, g, None, "late", tag=1, forward_key="old").result(timeout=30)
    assert kept.activations.counters.activation_misses == 1  # recomputed at the new parameters


def test_other_input_under_the_same_id_is_recomputed():
    kept, plain = middle(8), middle(0)
    try:
        x, other, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16)
        kept.forward(x, key="f").result(timeout=30)
        a = kept.backward(other, g, None, "c", forward_key="f").result(timeout=30).grad_input
        b = plain.backward(other, g, None, "c").result(timeout=30).grad_input
        assert kept.activations.counters.activation_misses == 1 and torch.allclose(a, b, atol=1e-6)
    finally:
        kept.stop()
        plain.stop()


def test_budget_and_age_bound_what_is_kept():
    cache = ActivationCache(budget_bytes=1000, ttl_s=60.0)
    t = torch.zeros(1)
    assert not cache.put("big", t, t, 2000)  # alone over the budget: not kept
    assert cache.put("a", t, t, 600) and cache.put("b", t, t, 600)  # b evicts a
    assert len(cache) == 1 and cache.nbytes == 600 and cache.counters.activations_evicted == 1
    assert cache.take("a", t) is None and cache.take("b", t) is not None
    old = ActivationCache(budget_bytes=1000, ttl_s=0.0)
    old.put("x", t, t, 10)
    assert old.take("x", t) is None and old.counters.activations_evicted == 1


def test_validation_and_last_stage_keep_nothing():
    last = StageExecutor(build_stage(GPT, 2, 3), OptimConfig(), activation_budget_bytes=1 << 20)
    try:
        last.forward(torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8)), key="f").result(timeout=30)
        assert len(last.activations) == 0
    finally:
        last.stop()
    mid = middle(8)
    try:
        mid.forward(torch.randn(2, 8, 16), validation=True, key="v").result(timeout=30)
        assert len(mid.activations) == 0
    finally:
        mid.stop()


def test_wiring_prefers_the_forwards_peer_unless_clearly_busier():
    a = PeerLoad("a", 1, "x", throughput=10.0)
    b = PeerLoad("b", 1, "y", throughput=10.0, reported_queue=1.0)
    wiring = Wiring()
    assert wiring.choose([a, b], 4, 0.0, prefer="b") is b  # finish 0.5 s vs 0.4 s: within the slack
    b.reported_queue = 40.0
    assert wiring.choose([a, b], 4, 0.0, prefer="b") is a  # 4.4 s vs 0.4 s: too busy
    b.reported_queue, b.banned_until = 0.0, 10.0
    assert wiring.choose([a, b], 4, 0.0, prefer="b") is a  # banned: not eligible
