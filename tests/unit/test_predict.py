"""Async look-ahead: microbatches meant for a pending update are computed at the parameters that
update is expected to give. The oracle is the real optimizer stepping a copy."""

import copy

import pytest
import torch

from swarm.peer.executor import StageExecutor
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage
from swarm.training.optim import apply_update, build_optimizer, expected_mean_gradient, predicted_params

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


@pytest.mark.parametrize("clip_norm", [0.0, 1e-3, 1.0])
def test_predicted_params_equal_a_real_update(clip_norm):
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=2, total_steps=10, clip_norm=clip_norm)
    torch.manual_seed(0)
    module = build_stage(GPT, 1, 2).module
    optimizer = build_optimizer(module, cfg)
    params = [p for p in module.parameters() if p.requires_grad]
    for step in range(4):  # the first step has no optimizer state yet; later ones do
        grads = [torch.randn_like(p) for p in params]
        predicted = predicted_params(optimizer, cfg, step, grads)
        before = [p.detach().clone() for p in params]
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # nothing changed
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        apply_update(optimizer, cfg, step)
        for p, q in zip(params, predicted, strict=True):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-7)
        assert any(not torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_predicted_params_reject_a_wrong_gradient_count():
    module = build_stage(GPT, 1, 2).module
    with pytest.raises(ValueError, match="gradients for"):
        predicted_params(build_optimizer(module, OptimConfig()), OptimConfig(), 0, [])


def test_expected_mean_gradient_shrinks_toward_the_momentum():
    cfg = OptimConfig()
    module = build_stage(GPT, 1, 2).module
    optimizer = build_optimizer(module, cfg)
    params = [p for p in module.parameters() if p.requires_grad]
    sums = [torch.randn_like(p) for p in params]
    # no optimizer state yet: the plain mean, or nothing at all
    assert expected_mean_gradient(optimizer, None, 0, 8) is None
    for got, s in zip(expected_mean_gradient(optimizer, sums, 4, 8), sums, strict=True):
        torch.testing.assert_close(got, s / 4)
    for p in params:
        p.grad = torch.randn_like(p)
    apply_update(optimizer, cfg, 0)
    moments = [optimizer.state[p]["exp_avg"] / (1 - cfg.beta1) for p in params]  # bias-corrected, step 1
    for got, m in zip(expected_mean_gradient(optimizer, None, 0, 8), moments, strict=True):
        torch.testing.assert_close(got, m)
    for got, s, m in zip(expected_mean_gradient(optimizer, sums, 4, 8), sums, moments, strict=True):
        torch.testing.assert_close(got, (s + 8 * m) / 12)
    for got, s in zip(expected_mean_gradient(optimizer, sums, 4, 0), sums, strict=True):
        torch.testing.assert_close(got, s / 4)


def _grads_at(module, params_values, h, y):
    net = copy.deepcopy(module)
    trainable = [p for p in net.parameters() if p.requires_grad]
    with torch.no_grad():
        for p, v in zip(trainable, params_values, strict=True):
            p.copy_(v)
    net.train(True)
    loss = net(h, y).sum()
    return torch.autograd.grad(loss, trainable), float(loss.detach())


@pytest.mark.parametrize("predict", [True, False])
def test_run_ahead_backward_uses_the_predicted_parameters(predict):
    cfg = OptimConfig(lr=1e-2)
    ex = StageExecutor(build_stage(GPT, 1, 2), cfg, predict_params=predict)
    try:
        torch.manual_seed(1)
        h0, y0 = torch.randn(4, 8, 16), torch.randint(0, 64, (4, 8))
        h1, y1 = torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))
        ex.backward(h0, None, y0, "step0", 0).result(timeout=30)
        current = [p.detach().clone() for p in ex.params]
        acc0 = [g.clone() for g in ex.call(lambda: ex.acc.get(0).grads).result(timeout=30)]
        expected_at = predicted_params(ex.optimizer, cfg, 0, [g / 4 for g in acc0]) if predict else current

        ahead = ex.backward(h1, None, y1, "step1", 1).result(timeout=30)
        assert ahead.accumulated_step == 1
        assert all(torch.equal(p, c) for p, c in zip(ex.params, current, strict=True))  # restored
        want_grads, want_loss = _grads_at(ex.module, expected_at, h1, y1)
        assert float(ahead.loss.sum()) == pytest.approx(want_loss, rel=1e-5)
        got = ex.call(lambda: ex.acc.get(1).grads).result(timeout=30)
        for g, w in zip(got, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
        assert ex.lookahead.counters.predicted_samples == (2 if predict else 0)

        # forward of a run-ahead microbatch: the same parameters; validation: the current ones
        fwd = ex.forward(h1, y1, tag=1).result(timeout=30)
        assert float(fwd.loss.sum()) == pytest.approx(want_loss, rel=1e-5)
        assert (fwd.params_step, fwd.predicted, ahead.params_step, ahead.predicted) == (0, predict, 0, predict)
        val = ex.forward(h1, y1, validation=True, tag=1).result(timeout=30)
        _, current_loss = _grads_at(ex.module, current, h1, y1)
        # a spot check's reference answer: the applied parameters, whatever the step it is for
        ref = ex.forward(h1, y1, tag=1, reference=True).result(timeout=30)
        assert float(ref.loss.sum()) == pytest.approx(current_loss, rel=1e-5) and not ref.predicted
        ref_back = ex.backward(h1, None, y1, "ref", 1, check_only=True, reference=True).result(timeout=30)
        assert float(ref_back.loss.sum()) == pytest.approx(current_loss, rel=1e-5) and not ref_back.predicted
        # dropout is off in this model, so train and eval mode agree
        assert float(val.loss.sum()) == pytest.approx(current_loss, rel=1e-5)

        # applying update 0 with this peer's own mean gradient lands exactly on the prediction
        ex.call(lambda: ex.apply_mean_gradient([g / 4 for g in acc0], 0)).result(timeout=30)
        if predict:
            for p, q in zip(ex.params, expected_at, strict=True):
                torch.testing.assert_close(p.detach(), q, rtol=1e-5, atol=1e-7)
    finally:
        ex.stop()
