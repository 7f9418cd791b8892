"""Model specs and stage construction.

A model spec is a small JSON-able dict (it travels in the run config record on the DHT):
- {"kind": "gpt", ...GPTConfig fields, "layer_split": [..] | None}
- {"kind": "mlp", ...MLPConfig fields}
- {"kind": "identity", "dim": N}: stages that return their input (the last: the mean square as a
  per-sample loss); no compute, for measuring the wire path (scripts/bench_wire.py)
- {"kind": "custom", "factory": "package.module:build_stages", "kwargs": {...}, "seed": 0,
   "input_dtype": "float32", "input_shape": [...], "input_range": [lo, hi], "targets_dtype": "int64",
   "targets_shape": [...], "targets_range": [lo, hi]}: build_stages(num_stages=S, **kwargs) returns the
  list of S stage modules. Stage k < S-1 maps its input to the next stage's input; the last stage is
  called as stage(x, targets) and returns the per-sample loss (shape [batch]) or the mean loss (a
  scalar). Shapes are per sample (no batch dimension). `--custom-model` fills these keys from the
  module's SWARM declaration (models/custom.py).

Every stage comes with a `StageSchema`, checked against each request before any compute.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from swarm.core.checks import all_finite
from swarm.core.errors import RequestInvalid
from swarm.training.models.custom import build_custom_stages, load_factory, trace_input, value_range
from swarm.training.models.gpt import GPT, GPTConfig, build_gpt_stage
from swarm.training.models.mlp import MLPConfig, MLPStage, build_mlp_stage


@dataclass(frozen=True)
class TensorSchema:
    """What a tensor must look like, without its batch dimension. A None dim may vary up to `max_dims`."""

    dtype: torch.dtype
    dims: tuple[int | None, ...]
    max_dims: tuple[int | None, ...] = ()
    value_range: tuple[int, int] | None = None  # for integer ids: lo <= v < hi

    def check_shape(self, shape: tuple[int, ...], dtype: torch.dtype, what: str, max_batch: int) -> None:
        """The shape and dtype a tensor must have, checked before any buffer for it exists (a
        stream header may declare [1, 100000, 100000]: nothing is allocated for it)."""
        if dtype != self.dtype:
            raise RequestInvalid(f"{what} has dtype {dtype}, expected {self.dtype}")
        if len(shape) != 1 + len(self.dims):
            raise RequestInvalid(f"{what} has shape {list(shape)}, expected [batch, {', '.join(map(_dim, self.dims))}]")
        if not 1 <= shape[0] <= max_batch:
            raise RequestInvalid(f"{what} has batch size {shape[0]}, allowed 1..{max_batch}")
        for i, (actual, want) in enumerate(zip(shape[1:], self.dims, strict=True)):
            limit = self.max_dims[i] if i < len(self.max_dims) else None
            if want is not None and actual != want:
                raise RequestInvalid(f"{what} has shape {list(shape)}, dim {i + 1} must be {want}")
            if want is None and (actual < 1 or (limit is not None and actual > limit)):
                raise RequestInvalid(f"{what} has shape {list(shape)}, dim {i + 1} must be in 1..{limit}")

    def check(self, tensor: torch.Tensor, what: str, max_batch: int) -> None:
        self.check_shape(tuple(tensor.shape), tensor.dtype, what, max_batch)
        if self.dtype.is_floating_point:
            if not all_finite(tensor):
                raise RequestInvalid(f"{what} contains NaN or infinity")
        elif self.value_range is not None and tensor.numel():
            lo, hi = self.value_range
            if tensor.min().item() < lo or tensor.max().item() >= hi:
                raise RequestInvalid(f"{what} has values outside [{lo}, {hi})")


def _dim(d: int | None) -> str:
    return "*" if d is None else str(d)


@dataclass(frozen=True)
class StageSchema:
    input: TensorSchema
    targets: TensorSchema | None  # last stage only
    is_first: bool
    is_last: bool


@dataclass
class BuiltStage:
    module: nn.Module
    schema: StageSchema
    stage: int
    num_stages: int


def _config_from(cls, spec: dict):
    names = {f.name for f in fields(cls)}
    unknown = set(spec) - names - {"kind", "layer_split"}
    if unknown:
        raise ValueError(f"unknown {spec.get('kind')} model settings: {sorted(unknown)}")
    return cls(**{k: v for k, v in spec.items() if k in names})


def validate_spec(spec: dict, num_stages: int) -> None:
    """Raise ValueError with a clear message if the spec cannot be built into `num_stages` stages."""
    if num_stages < 1:
        raise ValueError(f"number of stages must be >= 1, got {num_stages}")
    kind = spec.get("kind")
    if kind == "gpt":
        cfg = _config_from(GPTConfig, spec)
        from swarm.training.models.gpt import split_layers

        split_layers(cfg.n_layers, num_stages, spec.get("layer_split"))
    elif kind == "mlp":
        cfg = _config_from(MLPConfig, spec)
        if num_stages > cfg.n_layers:
            raise ValueError(f"cannot split {cfg.n_layers} MLP layers into {num_stages} stages")
    elif kind == "identity":
        if int(spec.get("dim", 0)) < 1:
            raise ValueError("identity model needs 'dim' >= 1")
    elif kind == "custom":
        if ":" not in str(spec.get("factory", "")):
            raise ValueError("custom model needs 'factory': 'package.module:build_stages'")
    else:
        raise ValueError(f"unknown model kind {kind!r}; choose gpt, mlp or custom")


def build_stage(spec: dict, stage: int, num_stages: int) -> BuiltStage:
    validate_spec(spec, num_stages)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} outside 0..{num_stages - 1}")
    first, last = stage == 0, stage == num_stages - 1
    kind = spec["kind"]
    if kind == "gpt":
        cfg = _config_from(GPTConfig, spec)
        module = build_gpt_stage(cfg, stage, num_stages, spec.get("layer_split"))
        if first:
            inp = TensorSchema(torch.int64, (None,), (cfg.seq_len,), (0, cfg.vocab_size))
        else:
            inp = TensorSchema(torch.float32, (None, cfg.d_model), (cfg.seq_len, None))
        targets = TensorSchema(torch.int64, (None,), (cfg.seq_len,), (0, cfg.vocab_size)) if last else None
        return BuiltStage(module, StageSchema(inp, targets, first, last), stage, num_stages)
    if kind == "mlp":
        cfg = _config_from(MLPConfig, spec)
        module = build_mlp_stage(cfg, stage, num_stages)
        inp = TensorSchema(torch.float32, (cfg.in_dim if first else cfg.hidden,))
        targets = TensorSchema(torch.int64, (), (), (0, cfg.n_classes)) if last else None
        return BuiltStage(module, StageSchema(inp, targets, first, last), stage, num_stages)
    if kind == "identity":
        dim = int(spec["dim"])
        module = IdentityStage(last)
        targets = TensorSchema(torch.int64, (), (), (0, 1 << 30)) if last else None
        return BuiltStage(
            module, StageSchema(TensorSchema(torch.float32, (dim,)), targets, first, last), stage, num_stages
        )
    return _build_custom_stage(spec, stage, num_stages)


class IdentityStage(nn.Module):
    """Returns its input: a stage with no compute, for measuring the wire path."""

    def __init__(self, is_last: bool) -> None:
        super().__init__()
        self.is_last = is_last
        self.scale = nn.Parameter(torch.ones(()))  # an optimizer needs one parameter

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_last:
            return (x * self.scale).pow(2).mean(dim=1)
        return x if not torch.is_grad_enabled() else x * self.scale


def _build_custom_stage(spec: dict, stage: int, num_stages: int) -> BuiltStage:
    stages = build_custom_stages(spec, num_stages)
    x = trace_input(stages, spec, stage)
    first, last = stage == 0, stage == num_stages - 1
    inp = TensorSchema(x.dtype, tuple(x.shape[1:]), (), value_range(spec, "input") if first else None)
    targets = None
    if last:
        dtype = getattr(torch, spec.get("targets_dtype", "int64"))
        targets = TensorSchema(dtype, tuple(spec.get("targets_shape", ())), (), value_range(spec, "targets"))
    return BuiltStage(stages[stage], StageSchema(inp, targets, first, last), stage, num_stages)


def stage_costs(spec: dict, num_stages: int) -> list[float] | None:
    """Relative compute per sample of each stage (forward FLOPs estimate), for rebalancing: a peer
    moving to a stage twice as costly delivers half the samples/s. None when unknown (custom)."""
    kind = spec.get("kind")
    if kind == "gpt":
        from swarm.training.models.gpt import split_layers

        cfg = _config_from(GPTConfig, spec)
        d, t = cfg.d_model, cfg.seq_len
        block = t * (8 * d * d + 4 * d * cfg.d_ff + 4 * t * d)  # qkv+proj, mlp, attention scores/values
        head = t * 2 * d * cfg.vocab_size
        ranges = split_layers(cfg.n_layers, num_stages, spec.get("layer_split"))
        costs = [(hi - lo) * block for lo, hi in ranges]
        costs[-1] += head
        return [max(c, 1.0) for c in costs]
    if kind == "mlp":
        from swarm.training.models.gpt import split_layers

        cfg = _config_from(MLPConfig, spec)
        costs = []
        for lo, hi in split_layers(cfg.n_layers, num_stages):
            costs.append(sum((cfg.in_dim if i == 0 else cfg.hidden) * cfg.hidden for i in range(lo, hi)))
        costs[-1] += cfg.hidden * cfg.n_classes
        return [max(float(c), 1.0) for c in costs]
    return None


def build_full_model(spec: dict) -> nn.Module:
    """The unsplit model (for export and for checking against single-process training)."""
    kind = spec.get("kind")
    if kind == "gpt":
        return GPT(_config_from(GPTConfig, spec))
    if kind == "mlp":
        cfg = _config_from(MLPConfig, spec)
        return MLPStage(cfg, 0, cfg.n_layers, with_head=True)
    raise ValueError(f"model kind {kind!r} has no unsplit class; export writes its stages' merged state_dict")


__all__ = [
    "GPT",
    "GPTConfig",
    "MLPConfig",
    "MLPStage",
    "BuiltStage",
    "StageSchema",
    "TensorSchema",
    "build_stage",
    "build_full_model",
    "load_factory",
    "validate_spec",
]
