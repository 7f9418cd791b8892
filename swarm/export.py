"""`swarm export`: merge the stages' checkpoints into one ordinary state_dict of the unsplit model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from swarm.training.state import CHECKPOINT_NAME, read_checkpoint

logger = logging.getLogger(__name__)


def stage_dirs(root: Path) -> dict[int, Path]:
    dirs = {}
    for p in root.iterdir() if root.is_dir() else []:
        if p.is_dir() and p.name.startswith("stage") and p.name[5:].isdigit():
            dirs[int(p.name[5:])] = p
    return dirs


def available_steps(stage_dir: Path) -> set[int]:
    return {int(m.group(1)) for p in stage_dir.iterdir() if (m := CHECKPOINT_NAME.match(p.name))}


def export(checkpoint_dir: str | Path, out: str | Path, step: int | None = None) -> dict:
    """Write the merged state_dict to `out`; returns {"step", "model_spec", "num_stages", "parameters"}."""
    root = Path(checkpoint_dir)
    dirs = stage_dirs(root)
    if not dirs:
        raise ValueError(f"no stage checkpoints under {root} (expected {root}/stage0/step00000050.pt, ...)")
    states = {}
    steps = {k: available_steps(d) for k, d in dirs.items()}
    if step is None:
        common = set.intersection(*steps.values())
        if not common:
            raise ValueError(
                f"the stages have no checkpoint step in common: { ({k: sorted(v) for k, v in steps.items()}) }"
            )
        step = max(common)
    for k, d in sorted(dirs.items()):
        if step not in steps[k]:
            raise ValueError(f"stage {k} has no checkpoint at step {step} (has {sorted(steps[k])})")
        states[k] = read_checkpoint((d / f"step{step:08d}.pt").read_bytes())
    num_stages = {s.get("meta", {}).get("num_stages") for s in states.values()}
    specs = {s.get("meta", {}).get("model_spec") for s in states.values()}
    if len(num_stages) != 1 or len(specs) != 1:
        raise ValueError("the checkpoints come from different runs (model spec or number of stages differ)")
    (n,) = num_stages
    if sorted(states) != list(range(n)):
        raise ValueError(f"need checkpoints of stages 0..{n - 1}, found {sorted(states)}")
    merged: dict[str, torch.Tensor] = {}
    for k in range(n):
        for name, tensor in states[k]["model"].items():
            if name in merged:
                raise ValueError(f"parameter {name} appears in two stages")
            merged[name] = tensor
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(merged, out)
    (spec,) = specs
    return {
        "step": step,
        "model_spec": json.loads(spec),
        "num_stages": n,
        "parameters": sum(t.numel() for t in merged.values()),
        "out": str(out),
    }
