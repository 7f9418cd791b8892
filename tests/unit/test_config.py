"""Broken configs get clear errors before anything starts."""

import pytest

from swarm.training.config import OptimConfig, RunConfig
from swarm.training.optim import lr_at


def test_round_trip_json_and_size():
    run = RunConfig(run_id="r1")
    text = run.to_json()
    assert len(text) < 3000
    assert RunConfig.from_json(text) == run


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(run_id="bad id!"), "run id"),
        (dict(codec="zip"), "codec"),
        (dict(sync="sometimes"), "sync"),
        (dict(num_stages=0), "num_stages"),
        (dict(microbatch=0), "batch"),
        (dict(sync="exact", global_batch=30, microbatch=8, num_trainers=2), "exact mode"),
        (dict(model={"kind": "gpt", "n_layers": 2}, num_stages=3), "split"),
        (dict(max_staleness=-0.5), "max_staleness"),
        (dict(max_staleness="1"), "max_staleness"),
        (dict(ahead_after=2), "ahead_after"),
    ],
)
def test_invalid_configs(kwargs, match):
    base = dict(run_id="r1")
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        RunConfig(**base)


def test_unknown_fields_rejected():
    with pytest.raises(ValueError, match="unknown run config fields"):
        RunConfig.from_dict({"run_id": "r", "bogus": 1})


def test_lr_schedule_warmup_then_cosine():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(cfg, s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(cfg, 4) == pytest.approx(1.0)
    assert lr_at(cfg, 9) == pytest.approx(0.55)
    assert lr_at(cfg, 14) == pytest.approx(0.1)
    assert lr_at(cfg, 100) == pytest.approx(0.1)
