"""A small MLP classifier that splits into stages: the fast model for tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    in_dim: int = 32
    hidden: int = 64
    n_layers: int = 4
    n_classes: int = 10
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("in_dim", "hidden", "n_layers", "n_classes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLP {name} must be positive, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


class MLPStage(nn.Module):
    """Layers [first, last) of the MLP; the last stage adds the classifier head and per-sample loss."""

    def __init__(self, cfg: MLPConfig, first: int, last: int, with_head: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(
            {str(i): nn.Linear(cfg.in_dim if i == 0 else cfg.hidden, cfg.hidden) for i in range(first, last)}
        )
        self.with_head = with_head
        if with_head:
            self.head = nn.Linear(cfg.hidden, cfg.n_classes)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(cfg.seed)
            # Draw every layer's weights in order, keep this stage's: stages match the unsplit model.
            for i in range(cfg.n_layers + 1):
                fan_in = cfg.in_dim if i == 0 else cfg.hidden
                fan_out = cfg.n_classes if i == cfg.n_layers else cfg.hidden
                w = torch.randn(fan_out, fan_in, generator=gen) / fan_in**0.5
                target = (
                    self.head
                    if i == cfg.n_layers and with_head
                    else self.layers[str(i)]
                    if str(i) in self.layers
                    else None
                )
                if target is not None:
                    target.weight.copy_(w)
                    target.bias.zero_()

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers.values():
            x = F.relu(layer(x))
        if not self.with_head:
            return x
        logits = self.head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float(), targets, reduction="none")


def build_mlp_stage(cfg: MLPConfig, stage: int, num_stages: int) -> MLPStage:
    from swarm.training.models.gpt import split_layers

    first, last = split_layers(cfg.n_layers, num_stages)[stage]
    return MLPStage(cfg, first, last, with_head=stage == num_stages - 1)
