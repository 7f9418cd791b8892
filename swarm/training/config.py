"""The run configuration: what the coordinator publishes so that a peer needs only the run id to join.

Small per-component dataclasses, JSON-able, kept well under the DHT's value size comfort zone.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields

from swarm import __version__
from swarm.training.data import DataConfig
from swarm.training.models import validate_spec
from swarm.wire.codec import CODEC_NAMES

RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MAX_CONFIG_BYTES = 3000

DEFAULT_MODEL = {
    "kind": "gpt",
    "vocab_size": 256,
    "seq_len": 64,
    "d_model": 128,
    "n_layers": 6,
    "n_heads": 4,
    "d_ff": 512,
    "dropout": 0.0,
    "seed": 0,
}


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay, gradient clipping on the averaged gradient."""

    lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 5
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0  # 0 disables clipping

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.total_steps <= 0 or self.warmup_steps < 0 or self.clip_norm < 0:
            raise ValueError(f"invalid optimizer settings: {self}")


@dataclass(frozen=True)
class RunConfig:
    run_id: str
    num_stages: int = 3
    model: dict = field(default_factory=lambda: dict(DEFAULT_MODEL))
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    global_batch: int = 32  # samples per optimizer step (B)
    microbatch: int = 8  # samples per microbatch
    codec: str = "fp16"  # activations forward and gradients backward
    sync: str = "async"  # "exact": step t+1 starts after every stage applied step t
    # async: how far a trainer may run ahead, in steps' worth of its samples (0.5: half of the next step)
    max_staleness: float = 1.0
    # async: share of a trainer's samples of step t that must be done before it starts samples of
    # step t+1 while t is pending (so the look-ahead predicts from at least that much gradient)
    ahead_after: float = 0.75
    # async: compute run-ahead microbatches at the parameters the pending update is expected to give
    # (its optimizer step on the mean gradient accumulated so far) instead of the current ones
    predict_params: bool = True
    num_trainers: int = 1  # for disjoint data sharding and the per-trainer share of a global batch
    max_batch: int = 256  # largest batch a peer accepts in one request
    version: str = __version__

    def __post_init__(self) -> None:
        if not RUN_ID_PATTERN.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must match {RUN_ID_PATTERN.pattern}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        validate_spec(self.model, self.num_stages)
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"unknown codec {self.codec!r}; choose one of {sorted(CODEC_NAMES)}")
        if self.sync not in ("async", "exact"):
            raise ValueError(f"sync must be 'async' or 'exact', got {self.sync!r}")
        if self.microbatch < 1 or self.global_batch < 1 or self.microbatch > self.max_batch:
            raise ValueError(
                f"bad batch sizes: global {self.global_batch}, micro {self.microbatch}, max {self.max_batch}"
            )
        if self.num_trainers < 1:
            raise ValueError("num_trainers must be >= 1")
        share, rest = divmod(self.global_batch, self.num_trainers)
        if self.sync == "exact" and (rest or share % self.microbatch):
            raise ValueError(
                f"exact mode needs global_batch ({self.global_batch}) to split into whole microbatches "
                f"({self.microbatch}) for each of {self.num_trainers} trainers"
            )
        if not isinstance(self.max_staleness, (int, float)) or not 0 <= self.max_staleness <= 16:
            raise ValueError(f"max_staleness must be a number in [0, 16], got {self.max_staleness!r}")
        if not isinstance(self.ahead_after, (int, float)) or not 0 <= self.ahead_after <= 1:
            raise ValueError(f"ahead_after must be a share in [0, 1], got {self.ahead_after!r}")
        if not isinstance(self.predict_params, bool):
            raise ValueError(f"predict_params must be true or false, got {self.predict_params!r}")

    @property
    def trainer_share(self) -> int:
        """Samples per step that each trainer contributes."""
        return self.global_batch // self.num_trainers

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        text = json.dumps(self.to_dict(), separators=(",", ":"), sort_keys=True)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(f"run config is {len(text)} bytes, more than {MAX_CONFIG_BYTES} for a DHT record")
        return text

    @classmethod
    def from_dict(cls, d: dict) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown run config fields: {sorted(unknown)}")
        d = dict(d)
        if isinstance(d.get("data"), dict):
            d["data"] = DataConfig(**d["data"])
        if isinstance(d.get("optim"), dict):
            d["optim"] = OptimConfig(**d["optim"])
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))
