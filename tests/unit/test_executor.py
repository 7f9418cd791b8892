"""The compute thread: batched work equals separate work; duplicates and NaN accumulate nothing."""

import math

import pytest
import torch

from swarm.core.errors import ExecutorStopped, NonFiniteResult, RequestInvalid
from swarm.peer.executor import StageExecutor
from swarm.training.config import OptimConfig
from swarm.training.models import build_full_model, build_stage

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}


@pytest.fixture
def last_stage():
    ex = StageExecutor(build_stage(GPT, 1, 2), OptimConfig(), max_batch_samples=64)
    yield ex
    ex.stop()


def test_batched_backward_equals_unsplit_gradient(last_stage):
    torch.manual_seed(0)
    first = build_stage(GPT, 0, 2).module
    xs = [torch.randint(0, 64, (n, 8)) for n in (2, 3, 1)]
    ys = [torch.randint(0, 64, (n, 8)) for n in (2, 3, 1)]
    hs = [first(x).detach() for x in xs]
    futures = [last_stage.backward(h, None, y, f"r{i}") for i, (h, y) in enumerate(zip(hs, ys, strict=True))]
    results = [f.result(timeout=30) for f in futures]
    assert last_stage.samples_accumulated == 6
    # reference: the unsplit model's gradient of the summed per-sample loss
    full = build_full_model(GPT)
    loss = sum(full(x, y).sum() for x, y in zip(xs, ys, strict=True))
    loss.backward()
    ref = dict(full.named_parameters())
    frozen = last_stage.call(last_stage.take_accumulated).result()
    for (name, _), g in zip(last_stage.module.named_parameters(), frozen.grads, strict=True):
        assert torch.allclose(g, ref[name].grad, atol=1e-5), name
    assert frozen.samples == 6 and frozen.step == 0
    assert all(r.grad_input.shape == h.shape for r, h in zip(results, hs, strict=True))


def test_duplicate_request_is_not_accumulated_twice(last_stage):
    h = torch.randn(2, 8, 16)
    y = torch.randint(0, 64, (2, 8))
    a = last_stage.backward(h, None, y, "same").result(timeout=30)
    b = last_stage.backward(h, None, y, "same").result(timeout=30)
    assert not a.duplicate and b.duplicate
    assert last_stage.samples_accumulated == 2
    assert torch.allclose(a.grad_input, b.grad_input)


def test_a_repeat_of_an_applied_contribution_names_the_update_that_applied_it(last_stage):
    """The trainer releases a Backward record when the stage's ledger lists it from the step the answer
    names: a repeat answered with a later step (the peer's current one) was never released."""
    h, y = torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))
    first = last_stage.backward(h, None, y, "t0/0/0", 0).result(timeout=30)
    last_stage.call(last_stage.local_step).result(timeout=30)
    last_stage.call(last_stage.local_step).result(timeout=30)  # update 1, with nothing in it
    repeat = last_stage.backward(h, None, y, "t0/0/0", 0).result(timeout=30)
    assert (first.accumulated_step, first.duplicate) == (0, False)
    assert (repeat.accumulated_step, repeat.duplicate) == (0, True) and last_stage.step == 2
    assert last_stage.samples_accumulated == 0


def test_nan_input_gradient_is_rejected_and_state_kept(last_stage):
    mid = StageExecutor(build_stage({**GPT, "n_layers": 3}, 1, 3), OptimConfig())
    try:
        h = torch.randn(2, 8, 16)
        bad = torch.full((2, 8, 16), float("nan"))
        with pytest.raises(NonFiniteResult):
            mid.backward(h, bad, None, "nan").result(timeout=30)
        assert mid.samples_accumulated == 0
        ok = mid.backward(h, torch.randn(2, 8, 16), None, "ok").result(timeout=30)
        assert ok.grad_input is not None and mid.samples_accumulated == 2
    finally:
        mid.stop()


def test_local_step_applies_mean_gradient_and_advances(last_stage):
    before = [p.detach().clone() for p in last_stage.params]
    h, y = torch.randn(4, 8, 16), torch.randint(0, 64, (4, 8))
    last_stage.backward(h, None, y, "x").result(timeout=30)
    samples, norm = last_stage.call(last_stage.local_step).result(timeout=30)
    assert samples == 4 and norm > 0 and last_stage.step == 1 and last_stage.accumulating_step == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, last_stage.params, strict=True))


def test_shape_mismatch_is_an_error_not_a_crash(last_stage):
    with pytest.raises(RequestInvalid):
        last_stage.forward(torch.randn(2, 8, 15), torch.randint(0, 64, (2, 8))).result(timeout=30)
    assert last_stage.forward(torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))).result(timeout=30).loss.shape == (2,)


def test_stop_fails_pending_work():
    ex = StageExecutor(build_stage(GPT, 1, 2), OptimConfig())
    ex.stop()
    with pytest.raises(ExecutorStopped, match="stopped"):
        ex.forward(torch.randn(1, 8, 16))


def test_finite_gradients_whose_sum_would_overflow_are_refused():
    # found by the fuzzer (docs/FUZZING.md): ~40 Backwards to stage 0, each with token ids arange(8)
    # and an output gradient of 1e36 everywhere (finite, accepted), made the gradient sum infinite;
    # the update then wrote NaN into every parameter
    first = StageExecutor(build_stage(GPT, 0, 2), OptimConfig())
    try:
        ids, grad_out = torch.arange(8).unsqueeze(0), torch.full((1, 8, 16), 1e36)
        refused = 0
        for i in range(48):
            try:
                first.backward(ids, grad_out, None, f"big/0/{i}").result(timeout=30)
            except NonFiniteResult:
                refused += 1
        assert 0 < refused < 48
        frozen = first.acc.get(0)
        assert frozen.samples == 48 - refused and all(torch.isfinite(g).all() for g in frozen.grads)
        first.call(first.local_step).result(timeout=30)
        assert all(torch.isfinite(p).all() for p in first.params)
    finally:
        first.stop()


def test_the_given_ledger_is_kept_and_its_file_written(tmp_path):
    """An executor keeps the (empty, hence falsy) ledger it is given: its --ledger-dir file gets one
    line per applied update (an `or` once swapped it for a ledger without a file)."""
    from swarm.peer.ledger import StageLedger

    path = tmp_path / "stage1.jsonl"
    ledger = StageLedger(1, path)
    ex = StageExecutor(build_stage(GPT, 1, 2), OptimConfig(), ledger=ledger)
    try:
        assert ex.ledger is ledger
        ex.backward(torch.randn(4, 8, 16), None, torch.randint(0, 64, (4, 8)), "x").result(timeout=30)
        ex.call(ex.local_step).result(timeout=30)
        assert len(path.read_text().splitlines()) == 1 and len(ledger) == 1
    finally:
        ex.stop()


def test_a_cheap_forward_runs_inline_only_while_the_compute_thread_is_idle():
    """The inline path (swarm.peer.executor.thread): same result as the compute thread's, never at the
    same time as a batch there, and only for forwards measured to be cheap."""
    import threading

    ex = StageExecutor(build_stage({"kind": "identity", "dim": 16}, 0, 2), OptimConfig())
    try:
        x = torch.randn(4, 16)
        first = ex.forward(x, validation=True, inline=True).result(timeout=30)  # not measured yet: thread
        assert ex.inline_tasks == 0 and ex.forward_s_per_sample is not None
        ex.forward_s_per_sample = 1e-6  # cheap: runs on this thread
        done = ex.forward(x, validation=True, inline=True)
        assert done.done() and ex.inline_tasks == 1
        assert torch.equal(done.result().output, first.output)
        assert ex.counters_dict()["inline_forwards"] == 1

        release, started = threading.Event(), threading.Event()
        blocker = ex.call(lambda: (started.set(), release.wait(30)))
        assert started.wait(30)
        queued = ex.forward(x, validation=True, inline=True)  # the thread is busy: queued behind it
        assert not queued.done() and ex.inline_tasks == 1
        release.set()
        assert torch.equal(queued.result(timeout=30).output, first.output)
        blocker.result(timeout=30)

        ex.forward_s_per_sample = 1.0  # expensive: never inline
        ex.forward(x, validation=True, inline=True).result(timeout=30)
        assert ex.inline_tasks == 1
        ex.forward_s_per_sample = 1e-6
        ex.forward(x, validation=True).result(timeout=30)  # inline not asked for
        assert ex.inline_tasks == 1
    finally:
        ex.stop()


def test_abs_bound_and_gradient_norm_cover_every_tensor_in_one_pass():
    from swarm.core.checks import abs_bound, gradient_norm

    ts = [torch.tensor([1.0, -3.0]), None, torch.tensor([2.0], dtype=torch.bfloat16), torch.empty(0)]
    assert 3.0 <= abs_bound(ts) <= 10**0.5 + 1e-6 and abs_bound([]) == 0.0
    assert math.isnan(abs_bound([torch.tensor([1.0, float("nan")]), torch.ones(2)]))
    assert math.isinf(abs_bound([torch.ones(2), torch.tensor([float("-inf")])]))
    huge = torch.full((4,), 1e30)  # finite, but its squares overflow: the exact maximum decides
    assert abs_bound([huge, torch.ones(2)]) == float(huge[0])
    assert abs(gradient_norm([torch.tensor([3.0]), torch.tensor([4.0])]) - 5.0) < 1e-12
