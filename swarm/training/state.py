"""A stage's training state (parameters, optimizer state, step): serialization, validation and
checkpoints on disk (its transfer between peers: swarm.peer.state_transfer).

A state is checked before it is used: the same parameter names, shapes and dtypes as this peer's
module, optimizer state shaped as AdamW keeps it for those parameters, a step an int64 holds, only
finite values. A checkpoint file carries the sha256 of its bytes. A bad download or a corrupt
checkpoint is refused, never half-loaded.
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


STEP_LIMIT = 1 << 63  # a step travels as an int64 (Info)
# what AdamW (swarm.training.optim.build_optimizer) keeps per parameter
OPTIMIZER_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})


def _check_tensor(value: object, like: torch.Tensor, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.shape != like.shape:
        raise StateError(f"{what}: shape {getattr(value, 'shape', None)} != {tuple(like.shape)}")
    if value.dtype != like.dtype:
        raise StateError(f"{what}: dtype {value.dtype} != {like.dtype}")
    return value


def _optimizer_tensors(optimizer: object, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The per-parameter optimizer state's tensors, checked against the parameters (its param_groups
    are not used: swarm.peer.executor loads the state under this peer's own)."""
    per_param = optimizer.get("state") if isinstance(optimizer, dict) else None
    if not isinstance(per_param, dict) or not all(isinstance(i, int) and 0 <= i < len(params) for i in per_param):
        raise StateError(f"optimizer state must map parameter indices 0..{len(params) - 1} to their state")
    tensors = []
    for i, state in per_param.items():
        if not isinstance(state, dict) or set(state) != OPTIMIZER_STATE_KEYS:
            raise StateError(f"optimizer state of parameter {i} must hold {sorted(OPTIMIZER_STATE_KEYS)}")
        step = _check_tensor(state["step"], torch.tensor(0.0), f"optimizer step of parameter {i}")
        moments = [
            _check_tensor(state[k], params[i], f"optimizer {k} of parameter {i}") for k in ("exp_avg", "exp_avg_sq")
        ]
        if bool(step < 0) or bool((moments[1] < 0).any()):
            raise StateError(f"optimizer state of parameter {i} holds a negative step or second moment")
        tensors += [step, *moments]
    return tensors


def validate(state: dict, module: nn.Module, meta: dict | None = None) -> None:
    """Raise StateError unless `state` fits `module` (parameters, and optimizer state as
    swarm.training.optim's AdamW keeps it) and holds only finite values."""
    step = state.get("step")
    if not isinstance(step, int) or not 0 <= step < STEP_LIMIT:
        raise StateError(f"state step must be an int in [0, 2**63), got a {type(step).__name__} out of it")
    expected = module.state_dict()
    got = state["model"]
    names = set(got) if isinstance(got, dict) else set()
    if not isinstance(got, dict) or names != set(expected):
        missing, extra = sorted(map(str, set(expected) - names))[:5], sorted(map(str, names - set(expected)))[:5]
        raise StateError(f"state parameters differ: missing {missing}, unexpected {extra}")
    tensors = [_check_tensor(got[name], tensor, f"parameter {name}") for name, tensor in expected.items()]
    tensors += _optimizer_tensors(state["optimizer"], [p for p in module.parameters() if p.requires_grad])
    for t in tensors:
        if t.is_floating_point() and not all_finite(t):
            raise StateError("state holds NaN or infinite values")
    if meta is not None:
        got_meta = state.get("meta", {})
        for key, want in meta.items():
            value = got_meta.get(key) if isinstance(got_meta, dict) else None
            if type(value) is not type(want) or value != want:  # no foreign __eq__ (a tensor's)
                raise StateError(f"state {key} is not {want!r}")


# ---- checkpoints ----


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


CHECKPOINT_MAGIC = b"swarm checkpoint sha256="


def checkpoint_bytes(state: dict) -> bytes:
    """A checkpoint file: a line with the sha256 of the serialized state, then the state. torch.load
    checks no CRC: without it, a flipped bit in a tensor's bytes would load as another value."""
    data = serialize(state)
    return CHECKPOINT_MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data


def read_checkpoint(raw: bytes) -> dict:
    """The state in a checkpoint file's bytes; StateError when it is not one or fails its checksum."""
    start = len(CHECKPOINT_MAGIC) + 65
    if not raw.startswith(CHECKPOINT_MAGIC) or raw[start - 1 : start] != b"\n":
        raise StateError("not a checkpoint with a checksum (damaged, or written before checkpoints had one)")
    data = memoryview(raw)[start:]
    if hashlib.sha256(data).hexdigest().encode() != raw[len(CHECKPOINT_MAGIC) : start - 1]:
        raise StateError("checkpoint checksum mismatch: the file is damaged")
    return deserialize(data)


class CheckpointStore:
    """DIR/stage{k}/step{00000040}.pt (`checkpoint_bytes`), written atomically (temporary file,
    fsync, rename, fsync dir)."""

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
        data = checkpoint_bytes(state)
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
                state = read_checkpoint(ckpt.path.read_bytes())
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
