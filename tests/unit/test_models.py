"""Stages compose to exactly the unsplit model; user models load by import path."""

import pytest
import torch

from swarm.training.models import build_full_model, build_stage, validate_spec
from swarm.training.models.gpt import split_layers

GPT = {"kind": "gpt", "vocab_size": 256, "seq_len": 16, "d_model": 32, "n_layers": 5, "n_heads": 4, "d_ff": 64}
MLP = {"kind": "mlp", "in_dim": 8, "hidden": 16, "n_layers": 4, "n_classes": 3}


def run_stages(spec, num_stages, x, y):
    stages = [build_stage(spec, k, num_stages).module for k in range(num_stages)]
    h = x
    for s in stages[:-1]:
        h = s(h)
    return stages, stages[-1](h, y)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 5])
def test_gpt_stages_equal_unsplit_model(num_stages):
    x = torch.randint(0, 256, (3, 16))
    y = torch.randint(0, 256, (3, 16))
    full = build_full_model(GPT)
    stages, loss = run_stages(GPT, num_stages, x, y)
    assert torch.allclose(loss, full(x, y), atol=1e-6)
    merged = {}
    for s in stages:
        merged.update(s.state_dict())
    ref = full.state_dict()
    assert merged.keys() == ref.keys()
    assert all(torch.equal(merged[k], ref[k]) for k in ref)
    assert loss.shape == (3,)  # per-sample loss


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_mlp_stages_equal_unsplit_model(num_stages):
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    full = build_full_model(MLP)
    _, loss = run_stages(MLP, num_stages, x, y)
    assert torch.allclose(loss, full(x, y), atol=1e-6)


def test_initial_loss_near_log_vocab():
    full = build_full_model({**GPT, "seed": 3})
    x = torch.randint(0, 256, (8, 16))
    assert abs(full(x, x).mean().item() - torch.log(torch.tensor(256.0)).item()) < 0.2


def test_split_layers():
    assert split_layers(6, 3) == [(0, 2), (2, 4), (4, 6)]
    assert split_layers(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_layers(6, 3, [1, 1, 4]) == [(0, 1), (1, 2), (2, 6)]
    with pytest.raises(ValueError):
        split_layers(2, 3)
    with pytest.raises(ValueError):
        split_layers(6, 3, [1, 1, 1])


@pytest.mark.parametrize(
    "spec, match",
    [
        ({"kind": "rnn"}, "unknown model kind"),
        ({**GPT, "d_model": 30}, "divisible"),
        ({**GPT, "bogus": 1}, "unknown gpt model settings"),
        ({"kind": "custom"}, "factory"),
    ],
)
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        validate_spec(spec, 2)


def test_schema_checks():
    schema = build_stage(GPT, 0, 2).schema
    schema.input.check(torch.randint(0, 256, (2, 16)), "input", 8)
    with pytest.raises(ValueError, match="dtype"):
        schema.input.check(torch.zeros(2, 16), "input", 8)
    with pytest.raises(ValueError, match="outside"):
        schema.input.check(torch.full((2, 16), 300), "input", 8)
    with pytest.raises(ValueError, match="batch size"):
        schema.input.check(torch.zeros(9, 16, dtype=torch.long), "input", 8)
    with pytest.raises(ValueError, match="dim 1"):
        schema.input.check(torch.zeros(2, 17, dtype=torch.long), "input", 8)
    mid = build_stage(GPT, 1, 2).schema
    with pytest.raises(ValueError, match="NaN"):
        mid.input.check(torch.full((2, 16, 32), float("nan")), "input", 8)
    with pytest.raises(ValueError, match="shape"):
        mid.input.check(torch.zeros(2, 16, 31), "input", 8)


def test_custom_model_by_import_path():
    spec = {"kind": "custom", "factory": "tests.toy_model:build_stages", "kwargs": {"width": 6}, "input_shape": [4]}
    stages = [build_stage(spec, k, 3) for k in range(3)]
    assert stages[1].schema.input.dims == (6,)
    x, y = torch.randn(2, 4), torch.randint(0, 2, (2,))
    h = x
    for s in stages[:-1]:
        h = s.module(h)
    assert stages[-1].module(h, y).dim() == 0
    with pytest.raises(ValueError, match="cannot import"):
        build_stage({**spec, "factory": "tests.nope:build"}, 0, 3)
