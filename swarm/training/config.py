"""The run configuration: what the coordinator publishes so that a peer needs only the run id to join.

Small per-component dataclasses, JSON-able, kept well under the DHT's value size comfort zone.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields

from swarm.core.settings import setting
from swarm.core.states import SyncMode
from swarm.core.version import __version__
from swarm.training.data import DataConfig
from swarm.training.models import validate_spec
from swarm.wire.names import CODECS

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


# `--model NAME`: the built-in model specs
MODEL_PRESETS: dict[str, dict] = {
    "gpt": DEFAULT_MODEL,
    "gpt-small": {
        "kind": "gpt",
        "vocab_size": 256,
        "seq_len": 128,
        "d_model": 256,
        "n_layers": 8,
        "n_heads": 8,
        "d_ff": 1024,
    },
    "mlp": {"kind": "mlp", "in_dim": 32, "hidden": 64, "n_layers": 4, "n_classes": 10},
}


def model_spec_from_text(text: str) -> dict:
    """A preset's name or a JSON model spec (validated with the run config)."""
    if text in MODEL_PRESETS:
        return dict(MODEL_PRESETS[text])
    try:
        spec = json.loads(text)
    except ValueError:
        spec = None
    if not isinstance(spec, dict):
        raise ValueError(f"--model must be one of {', '.join(MODEL_PRESETS)} or a JSON object spec, got {text!r}")
    return spec


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay, gradient clipping on the averaged gradient."""

    lr: float = setting(3e-3, "peak learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    beta1: float = setting(0.9, "AdamW beta1")
    beta2: float = setting(0.95, "AdamW beta2")
    eps: float = setting(1e-8, "AdamW epsilon")
    warmup_steps: int = setting(5, "linear warmup steps")
    total_steps: int = setting(1000, "cosine schedule length (swarm local: --steps)")
    min_lr_ratio: float = setting(0.1, "the cosine schedule ends at this fraction of the peak learning rate")
    clip_norm: float = setting(1.0, "per-stage gradient clipping of the averaged gradient; 0 disables")

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.total_steps <= 0 or self.warmup_steps < 0 or self.clip_norm < 0:
            raise ValueError(f"invalid optimizer settings: {self}")


@dataclass(frozen=True)
class RunConfig:
    run_id: str = setting(help="the run's id", cli=False)
    num_stages: int = setting(3, "pipeline stages", cli=False)
    model: dict = setting(factory=lambda: dict(DEFAULT_MODEL), help="the model spec", cli=False)
    data: DataConfig = setting(factory=DataConfig, help="the dataset", cli=False)
    optim: OptimConfig = setting(factory=OptimConfig, help="the optimizer", cli=False)
    global_batch: int = setting(32, "samples per optimizer step (B)")
    microbatch: int = setting(8, "samples per microbatch")
    codec: str = setting("fp16", "compression of activations and gradients", choices=CODECS)
    sync: str = setting(
        "async", "exact: step t+1 starts after every stage applied step t", choices=tuple(m.value for m in SyncMode)
    )
    max_staleness: float = setting(
        1.0,
        "async: how far a trainer may run ahead of the slowest stage, in steps' worth of samples; fractions "
        "allowed (0.5: half of the next step's microbatches start early)",
    )
    ahead_after: float = setting(
        0.75,
        "async: share of a trainer's samples of a step that must be done before it starts samples of the next "
        "step while that step is pending (0: as soon as the bound allows)",
    )
    predict_params: bool = setting(
        True,
        "async: compute microbatches meant for a pending update at the parameters that update is expected to "
        "give (look-ahead), not the current ones",
    )
    num_trainers: int = setting(1, "trainers, for disjoint data sharding and each one's share of a batch", cli=False)
    max_batch: int = setting(256, "largest batch a peer accepts in one request")
    private: bool = setting(
        False, "a private swarm: only members the coordinator admitted may call peers or write records", cli=False
    )
    tls_ca: str = setting(
        "", "a private swarm's gRPC is over TLS under the CA whose public key has this SHA-256 (empty: plaintext)",
        cli=False,
    )  # fmt: skip
    version: str = setting(__version__, "the swarm version that wrote it", cli=False)

    def __post_init__(self) -> None:
        if not RUN_ID_PATTERN.match(self.run_id):
            raise ValueError(f"run id {self.run_id!r} must match {RUN_ID_PATTERN.pattern}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        validate_spec(self.model, self.num_stages)
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; choose one of {', '.join(CODECS)}")
        if self.sync not in tuple(SyncMode):
            raise ValueError(f"sync must be 'async' or 'exact', got {self.sync!r}")
        if self.microbatch < 1 or self.global_batch < 1 or self.microbatch > self.max_batch:
            raise ValueError(
                f"bad batch sizes: global {self.global_batch}, micro {self.microbatch}, max {self.max_batch}"
            )
        if self.num_trainers < 1:
            raise ValueError("num_trainers must be >= 1")
        share, rest = divmod(self.global_batch, self.num_trainers)
        if self.exact and (rest or share % self.microbatch):
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
        if self.tls_ca and not self.private:
            raise ValueError("tls_ca is for private swarms: TLS is chained to the run's authority")

    @property
    def exact(self) -> bool:
        return self.sync == SyncMode.EXACT

    def trainer_share(self, trainer_index: int, num_trainers: int | None = None) -> int:
        """Samples per step that trainer `trainer_index` contributes: the global batch split as
        evenly as possible (the first `global_batch % num_trainers` trainers take one more)."""
        base, extra = divmod(self.global_batch, num_trainers or self.num_trainers)
        return base + (1 if trainer_index < extra else 0)

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
