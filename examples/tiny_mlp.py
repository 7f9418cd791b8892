"""A model of your own, trained by a swarm from the command line: a small MLP classifier with its own dataset.

    swarm local --custom-model tiny_mlp:build_stages --custom-model-path examples --stages 2 --steps 40

What swarm needs from a model module (README.md, "Your own model"):
  build_stages(num_stages, **kwargs)  the stage modules: stage k < S-1 maps its input to stage k+1's input; the
                                      last stage is called as stage(x, targets) and returns the per-sample loss
  SWARM                               what stage 0 takes, what the last stage's targets are, and the data
  make_dataset(seed, ...)             (named in SWARM["data"]) an object with num_train, num_val,
                                      train(indices) and val(indices), each returning (inputs, targets)
Every process builds the same stages and the same data from the seed, so both must be deterministic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, CLASSES = 16, 4

SWARM = {
    "input": {"shape": [DIM], "dtype": "float32"},
    "targets": {"shape": [], "dtype": "int64", "range": [0, CLASSES]},
    "data": {"factory": "make_dataset"},
}


class Block(nn.Module):
    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class Head(nn.Module):
    """The last stage: a block, the classifier, and the per-sample cross-entropy."""

    def __init__(self, dim_in: int, hidden: int) -> None:
        super().__init__()
        self.block = Block(dim_in, hidden)
        self.out = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.out(self.block(x)), targets, reduction="none")


def build_stages(num_stages: int, hidden: int = 64) -> list[nn.Module]:
    if num_stages == 1:
        return [Head(DIM, hidden)]
    stages: list[nn.Module] = [Block(DIM, hidden)]
    stages += [Block(hidden, hidden) for _ in range(num_stages - 2)]
    stages.append(Head(hidden, hidden))
    return stages


class TeacherBlobs:
    """x ~ N(0, 1) in DIM dimensions, labelled by a fixed random linear teacher: learnable, deterministic."""

    def __init__(self, seed: int, samples: int) -> None:
        gen = torch.Generator().manual_seed(1234 + seed)
        teacher = torch.randn(DIM, CLASSES, generator=gen)
        self.x = torch.randn(samples + samples // 8, DIM, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)
        self.num_train, self.num_val = samples, samples // 8

    def train(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]

    def val(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = [self.num_train + i for i in indices]
        return self.x[idx], self.y[idx]


def make_dataset(seed: int = 0, samples: int = 8192) -> TeacherBlobs:
    return TeacherBlobs(seed, samples)
