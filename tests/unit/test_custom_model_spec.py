"""A model module's SWARM declaration becomes the run config's model spec and data config, the stages' schemas
follow it, and the data it names fits them; the allow-list hook refuses other factories."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from swarm.core.errors import ConfigError
from swarm.training.config import RunConfig
from swarm.training.data import DataConfig, load_dataset
from swarm.training.models import build_stage
from swarm.training.models.custom import ALLOW_ENV, custom_spec
from swarm.training.preflight import check_run

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(EXAMPLES)
    yield
    for name in ("tiny_mlp", "char_model"):
        sys.modules.pop(name, None)


def run_of(factory: str, stages: int, **data) -> RunConfig:
    model, model_data = custom_spec(factory)
    return RunConfig(run_id="t", num_stages=stages, model=model, data=DataConfig(**{**model_data, **data}))


def test_tiny_mlp_declaration_fills_spec_and_its_dataset_fits():
    run = run_of("tiny_mlp:build_stages", 3)
    assert run.model["input_shape"] == [16] and run.model["targets_range"] == [0, 4]
    assert run.data.kind == "custom" and run.data.factory == "tiny_mlp:make_dataset"
    check_run(run)
    stages = [build_stage(run.model, k, 3) for k in range(3)]
    x, y = load_dataset(run.data, run.model).train([0, 1, 2])
    for s in stages[:-1]:
        x = s.module(x)
    assert stages[-1].module(x, y).shape == (3,)  # per-sample loss


def test_char_model_uses_a_builtin_dataset_with_its_tokenizer():
    run = run_of("char_model:build_stages", 3, max_bytes=200_000)
    assert run.data.kind == "stdlib" and run.model["seq_len"] == 32 and run.model["vocab_size"] == 256
    check_run(run)
    first = build_stage(run.model, 0, 3).schema.input
    assert first.dtype == torch.int64 and first.dims == (32,) and first.value_range == (0, 256)


def test_mismatched_declaration_is_found_before_training(monkeypatch):
    run = run_of("tiny_mlp:build_stages", 2)
    bad = RunConfig(run_id="t", num_stages=2, model={**run.model, "targets_range": [0, 2]}, data=run.data)
    with pytest.raises(ConfigError, match="dataset's targets has values outside"):
        check_run(bad)  # the data has 4 classes, the declaration says 2


def test_allow_list_hook(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "trusted_models")
    with pytest.raises(ConfigError, match="not allowed"):
        custom_spec("tiny_mlp:build_stages")
    monkeypatch.setenv(ALLOW_ENV, "tiny_mlp,other")
    assert custom_spec("tiny_mlp:build_stages")[0]["factory"] == "tiny_mlp:build_stages"
