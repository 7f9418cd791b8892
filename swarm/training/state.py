"""A stage's training state (parameters, optimizer state, step): serialization, validation and
checkpoints on disk (its transfer between peers: swarm.peer.state_transfer).

A state is checked before it is used: the same parameter names and shapes as this peer's module, a
non-negative step, only finite values. A bad download or a corrupt checkpoint is refused, never
half-loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarm.core.checks import all_finite
from swarm.core.errors import StateError

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
CHECKPOINT_NAME = re.compile(r"^step(\d{8})\.pt$")


def serialize(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def deserialize(data: bytes) -> dict:
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure is a bad state
        raise StateError(f"cannot decode state: {e}") from None
    if not isinstance(state, dict) or not {"step", "model", "optimizer"} <= set(state):
        raise StateError("state must be a dict with step, model and optimizer")
    return state


def _tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def clone_tensors(obj: Any) -> Any:
    """A deep copy of the tensors of a nested dict/list (an optimizer state), on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clone_tensors(v) for v in obj]
    return obj


@torch.no_grad()
def parameter_fingerprint(params: list[torch.Tensor]) -> tuple[float, float]:
    """(sum, sum of |p|) of all parameters in float64. Cheap, and any divergence between stage-mates
    (a partial all-reduce, a missed update) moves it far beyond rounding noise."""
    total, absolute = 0.0, 0.0
    for p in params:
        flat = p.detach().reshape(-1)
        total += float(flat.sum(dtype=torch.float64))
        absolute += float(flat.abs().sum(dtype=torch.float64))
    return total, absolute


def validate(state: dict, module: nn.Module, meta: dict | None = None) -> None:
    """Raise StateError unless `state` fits `module` and holds only finite values."""
    step = state.get("step")
    if not isinstance(step, int) or step < 0:
        raise StateError(f"state step must be a non-negative int, got {step!r}")
    expected = module.state_dict()
    got = state["model"]
    if not isinstance(got, dict) or set(got) != set(expected):
        missing, extra = set(expected) - set(got or {}), set(got or {}) - set(expected)
        raise StateError(f"state parameters differ: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    for name, tensor in expected.items():
        if not isinstance(got[name], torch.Tensor) or got[name].shape != tensor.shape:
            raise StateError(f"parameter {name}: shape {getattr(got[name], 'shape', None)} != {tuple(tensor.shape)}")
        if got[name].dtype != tensor.dtype:
            raise StateError(f"parameter {name}: dtype {got[name].dtype} != {tensor.dtype}")
    for t in _tensors(state["model"]) + _tensors(state["optimizer"]):
        if t.is_floating_point() and not all_finite(t):
            raise StateError("state holds NaN or infinite values")
    if meta is not None:
        for key, want in meta.items():
            if state.get("meta", {}).get(key) != want:
                raise StateError(f"state {key} is {state.get('meta', {}).get(key)!r}, expected {want!r}")


# ---- checkpoints ----


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


class CheckpointStore:
    """DIR/stage{k}/step{00000040}.pt, written atomically (temporary file, fsync, rename, fsync dir)."""

    def __init__(self, root: str | Path, stage: int, keep: int = 3) -> None:
        self.dir = Path(root) / f"stage{stage}"
        self.keep = keep

    def list(self) -> list[Checkpoint]:
        if not self.dir.is_dir():
            return []
        found = []
        for p in self.dir.iterdir():
            m = CHECKPOINT_NAME.match(p.name)
            if m:
                found.append(Checkpoint(p, int(m.group(1))))
        return sorted(found, key=lambda c: c.step)

    def save(self, state: dict) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        step = int(state["step"])
        final = self.dir / f"step{step:08d}.pt"
        tmp = self.dir / f".step{step:08d}.pt.{os.getpid()}.tmp"
        data = serialize(state)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        for old in self.list()[: -self.keep] if self.keep > 0 else []:
            try:
                old.path.unlink()
            except OSError:
                pass
        return final

    def load_latest(self, module: nn.Module, meta: dict | None = None) -> tuple[dict, Checkpoint] | None:
        """The newest checkpoint that decodes and validates; corrupt ones are skipped with a warning."""
        for ckpt in reversed(self.list()):
            try:
                state = deserialize(ckpt.path.read_bytes())
                validate(state, module, meta)
                return state, ckpt
            except (OSError, StateError) as e:
                logger.warning("skipping checkpoint %s: %s", ckpt.path, e)
        return None


def checkpoint_meta(run_id: str, stage: int, num_stages: int, model_spec: dict) -> dict:
    spec = hashlib.sha256(json.dumps(model_spec, sort_keys=True).encode()).hexdigest()[:16]
    return {"run_id": run_id, "stage": stage, "num_stages": num_stages, "model": spec}


def stamp(state: dict, meta: dict, model_spec: dict) -> dict:
    state = dict(state)
    state["meta"] = {**meta, "model_spec": json.dumps(model_spec, sort_keys=True), "time": time.time()}
    return state
