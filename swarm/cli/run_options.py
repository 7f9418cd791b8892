"""The run configuration's command-line options (coordinator and `swarm local`): generated from
RunConfig, OptimConfig and DataConfig, each overriding the value of a `--config` file or the default."""

from __future__ import annotations

import argparse
import json
import os
import sys

from swarm.core.errors import ConfigError
from swarm.core.settings import add_settings, given
from swarm.training.config import MODEL_PRESETS, OptimConfig, RunConfig, model_spec_from_text
from swarm.training.data import DataConfig
from swarm.training.models.custom import custom_spec


def add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run configuration (published on the DHT by the coordinator)")
    g.add_argument("--config", metavar="FILE", help="a run config JSON file (the options below override its fields)")
    g.add_argument("--model", help=f"a preset ({', '.join(MODEL_PRESETS)}; default gpt) or a JSON model spec")
    g.add_argument(
        "--custom-model",
        metavar="PKG.MODULE:BUILD_STAGES",
        help="your own model: build_stages(num_stages=S) -> list of stage modules, and the module's SWARM "
        "declaration (input, targets, data; README.md 'Your own model')",
    )
    add_model_path_arg(g)
    g.add_argument("--seed", type=int, help="model initialization and data order seed (default 0)")
    add_settings(g, RunConfig, overrides_only=True)
    add_settings(g, OptimConfig, overrides_only=True)
    add_settings(g, DataConfig, overrides_only=True)


def _read_config_file(path: str) -> dict:
    try:
        with open(path) as f:
            base = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror}: give a run config JSON file") from None
    except ValueError as e:
        raise ConfigError(f"--config {path} is not valid JSON ({e}): fix the file") from None
    if not isinstance(base, dict):
        raise ConfigError(f"--config {path} must hold a JSON object of run config fields")
    return base


def add_model_path_arg(p) -> None:
    p.add_argument(
        "--custom-model-path",
        metavar="DIR",
        action="append",
        default=[],
        help="a folder to import --custom-model's module from (repeatable; PYTHONPATH works too)",
    )


def apply_model_path(args: argparse.Namespace) -> list[str]:
    """Put --custom-model-path folders first on this process's import path; returns them (absolute)."""
    paths = [os.path.abspath(p) for p in getattr(args, "custom_model_path", None) or []]
    for path in reversed(paths):
        if not os.path.isdir(path):
            raise ConfigError(f"--custom-model-path {path} is not a folder: give the folder that holds your module")
        if path not in sys.path:
            sys.path.insert(0, path)
    return paths


def _model(args: argparse.Namespace, base: dict) -> tuple[dict, dict]:
    """The model spec, and data fields the model declares (a custom model's SWARM['data'])."""
    if args.custom_model:
        apply_model_path(args)
        try:
            return custom_spec(args.custom_model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.model is not None:
        return model_spec_from_text(args.model), {}
    return (dict(base["model"]) if "model" in base else model_spec_from_text("gpt")), {}


def build_run_config(
    args: argparse.Namespace, run_id: str, stages: int, num_trainers: int, steps: int | None = None
) -> RunConfig:
    """The run config from a `--config` file (if any), overridden by the options given; exits with
    a clear message when it cannot work."""
    base = _read_config_file(args.config) if args.config else {}
    try:
        model, model_data = _model(args, base)
        if args.seed is not None and model.get("kind") != "custom":
            model["seed"] = args.seed
        data = {**base.get("data", {}), **model_data, **given(args, DataConfig)}
        if "kind" not in data and model.get("kind") == "mlp":
            data["kind"] = "synthetic"
        if args.seed is not None:
            data["seed"] = args.seed
        optim = {**base.get("optim", {}), **given(args, OptimConfig)}
        if "total_steps" not in optim and steps is not None:
            optim["total_steps"] = max(1, steps)
        skip = ("model", "data", "optim", "run_id", "num_stages", "num_trainers")
        fields = {k: v for k, v in base.items() if k not in skip}
        fields.update(given(args, RunConfig))
        return RunConfig(
            run_id=run_id,
            num_stages=stages,
            model=model,
            data=DataConfig(**data),
            optim=OptimConfig(**optim),
            num_trainers=num_trainers,
            **fields,
        )
    except (TypeError, ValueError) as e:
        raise ConfigError(f"invalid run configuration: {e}") from None
