"""Stage-mates share their gradient sums for the pending update, so that the look-ahead predicts it
from every gradient the stage holds. The oracle: one executor that holds all of those gradients."""

import pytest
import torch

from swarm.core.errors import StateError
from swarm.peer.executor import Accumulated, StageExecutor
from swarm.peer.partials import decode_partial, encode_partial
from swarm.training.config import OptimConfig
from swarm.training.models import build_stage

GPT = {"kind": "gpt", "vocab_size": 64, "seq_len": 8, "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32}
CFG = OptimConfig(lr=1e-2, warmup_steps=0)


def _executors(n: int) -> list[StageExecutor]:
    out = []
    for _ in range(n):
        torch.manual_seed(0)  # the same initial parameters, as stage-mates have
        out.append(StageExecutor(build_stage(GPT, 1, 2), CFG, predict_params=True, prior_samples=0))
    return out


def _batches(n: int):
    torch.manual_seed(1)
    return [(torch.randn(2, 8, 16), torch.randint(0, 64, (2, 8))) for _ in range(n)]


def _prediction(ex: StageExecutor) -> list[torch.Tensor]:
    return [
        p.clone() for p in ex.call(lambda: ex.lookahead.predicted(ex.acc.pending(ex.step), ex.step)).result(timeout=30)
    ]


def _wire(partial: Accumulated, step: int | None = None) -> tuple[dict, bytes]:
    """What a mate streams: the header (step and encode_partial's fields) and the raw bytes."""
    fields, data = encode_partial(partial)
    return {"step": partial.step if step is None else step, **fields}, data


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum((x - y).norm() ** 2 for x, y in zip(a, b, strict=True)) ** 0.5)


def test_a_mates_sum_makes_the_prediction_of_the_whole_stage():
    whole, mine, mate = _executors(3)
    try:
        batches = _batches(4)
        for i, (h, y) in enumerate(batches):
            whole.backward(h, None, y, f"w{i}", 0).result(timeout=30)
            (mine if i % 2 == 0 else mate).backward(h, None, y, f"m{i}", 0).result(timeout=30)
        want = _prediction(whole)
        alone = _prediction(mine)
        # the mate's sum goes over the wire format, in bfloat16
        header, data = _wire(mate.call(lambda: mate.partial_gradient(0)).result(timeout=30))
        assert len(data) == 2 * sum(p.numel() for p in mate.params)  # bfloat16, nothing else
        partial = decode_partial(header, data, mine.params, 0)
        assert partial.samples == 4 and all(g.dtype == torch.bfloat16 for g in partial.grads)
        assert [g.shape for g in partial.grads] == [p.shape for p in mine.params]
        assert mine.call(lambda: mine.set_mate_partial("mate", partial)).result(timeout=30)
        shared = _prediction(mine)
        assert mine.lookahead.counters.predictions_with_mates == 1
        # the mate's half moves the prediction onto the whole stage's, up to bfloat16 rounding (a
        # first Adam step is lr x sign(g): a coordinate whose halves nearly cancel may still differ)
        assert _distance(shared, want) < 0.05 * _distance(alone, want)
        # nothing of it touches the real parameters or this peer's own accumulator
        assert mine.samples_accumulated == 4
        # once the update is applied, the mate's sum is dropped with it
        mine.call(lambda: mine.apply_mean_gradient([torch.zeros_like(p) for p in mine.params], 0)).result(timeout=30)
        assert mine.lookahead.mate_partials == {}
    finally:
        for ex in (whole, mine, mate):
            ex.stop()


def test_a_sum_for_another_step_is_ignored_and_not_pending_gives_none():
    (ex,) = _executors(1)
    try:
        zeros = [torch.zeros_like(p, dtype=torch.bfloat16) for p in ex.params]
        assert not ex.call(lambda: ex.set_mate_partial("m", Accumulated(zeros, 2, 5))).result(timeout=30)
        assert ex.lookahead.mate_partials == {}
        assert ex.call(lambda: ex.partial_gradient(3)).result(timeout=30) is None
        empty = ex.call(lambda: ex.partial_gradient(0)).result(timeout=30)
        assert empty.samples == 0 and empty.grads is None
        with pytest.raises(ValueError, match="tensors"):
            ex.call(lambda: ex.set_mate_partial("m", Accumulated(zeros[:1], 2, 0))).result(timeout=30)
    finally:
        ex.stop()


def test_bad_partials_are_refused_with_clear_errors():
    (ex,) = _executors(1)
    try:
        params = ex.params
        flat = torch.ones(sum(p.numel() for p in params), dtype=torch.bfloat16)
        nan = flat.clone()
        nan[7] = float("nan")
        good_header, good = _wire(Accumulated([flat], 2, 0))
        cases = {
            "step": (dict(good_header, step=7), good),
            "non-negative": (dict(good_header, samples=-1), good),
            "dtype": (dict(good_header, dtype="float32"), good),
            "bytes": (good_header, good[:-2]),
            "NaN": _wire(Accumulated([nan], 2, 0)),
        }
        for needle, (header, data) in cases.items():
            with pytest.raises(StateError, match=needle):
                decode_partial(header, bytearray(data), params, 0)
        assert decode_partial(good_header, bytearray(good), params, 0).samples == 2
        assert decode_partial(*_wire(Accumulated(None, 0, 0)), params, 0).grads is None
    finally:
        ex.stop()


def test_frozen_sum_travels_exactly_and_stays_fetchable_after_the_update():
    """Direct averaging (swarm.peer.direct) moves each mate's frozen sum in float32: bit for bit, and
    still there for a slower mate after this peer applied the update."""
    (ex,) = _executors(1)
    try:
        for i, (h, y) in enumerate(_batches(2)):
            ex.backward(h, None, y, f"c{i}").result(timeout=30)
        assert ex.call(lambda: ex.frozen_gradient(0)).result(timeout=30) is None  # not frozen yet
        frozen = ex.call(ex.take_accumulated).result(timeout=30)
        assert ex.call(lambda: ex.frozen_gradient(0)).result(timeout=30) is None  # frozen, but not averaging
        ex.averaging_step = 0
        found, epoch = ex.call(lambda: ex.frozen_gradient(0)).result(timeout=30)
        header, data = _wire(found)
        assert header["dtype"] == "float32" and header["samples"] == 4 and epoch == ex.acc.epoch
        got = decode_partial(header, data, ex.params, 0, dtype="float32")
        for a, b in zip(got.grads, frozen.grads, strict=True):
            assert torch.equal(a, b)
        with pytest.raises(StateError):  # a float32 sum is not taken for a bfloat16 one
            decode_partial(header, data, ex.params, 0)
        mean = [g / 4 for g in frozen.grads]
        ex.call(lambda: ex.apply_mean_gradient(mean, 0)).result(timeout=30)
        again, _ = ex.call(lambda: ex.frozen_gradient(0)).result(timeout=30)
        assert torch.equal(again.grads[0], found.grads[0])
        assert ex.call(lambda: ex.frozen_gradient(1)).result(timeout=30) is None
    finally:
        ex.stop()


def test_a_frozen_sum_asked_for_early_says_how_long_its_owner_made_the_mate_wait():
    """A mate asks before this peer begins averaging the update: the request waits for it, and the
    header says how long (the asker counts it as waiting for a straggler, not as averaging)."""
    import asyncio
    import json

    from swarm.peer.partials import partial_chunks
    from swarm.wire.protocol import pb

    (ex,) = _executors(1)
    try:
        for i, (h, y) in enumerate(_batches(2)):
            ex.backward(h, None, y, f"c{i}").result(timeout=30)
        ex.call(ex.take_accumulated).result(timeout=30)

        async def fetch():
            asyncio.get_running_loop().call_later(0.2, lambda: setattr(ex, "averaging_step", 0))
            return [chunk async for chunk in partial_chunks(ex, pb.PartialRequest(step=0, frozen=True))]

        chunks = asyncio.run(fetch())
        header = json.loads(pb.Chunk.FromString(chunks[0]).header)
        assert header["step"] == 0 and 150 <= header["waited_ms"] < 3000
    finally:
        ex.averaging_step = None
        ex.stop()
