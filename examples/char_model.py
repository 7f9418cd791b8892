"""A character model of your own on a built-in dataset: the bytes of Python's standard library (no download).

    swarm local --custom-model char_model:build_stages --custom-model-path examples --stages 3 --steps 60

SWARM["data"] names a built-in dataset and its tokenizer instead of a factory: "stdlib" (or "text" with
--data-path, or "tokens"), cut into windows of seq_len byte tokens (vocabulary 256); the targets are the
inputs shifted by one. Each stage mixes a few previous characters (a causal convolution) and applies an MLP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SEQ_LEN, VOCAB, WIDTH = 32, 256, 64

SWARM = {
    "input": {"shape": [SEQ_LEN], "dtype": "int64", "range": [0, VOCAB]},
    "targets": {"shape": [SEQ_LEN], "dtype": "int64", "range": [0, VOCAB]},
    "data": {"kind": "stdlib", "seq_len": SEQ_LEN, "vocab_size": VOCAB},
}


class CausalMix(nn.Module):
    """x + MLP(norm(causal conv over the last 4 positions of x)); shape [batch, seq, width] in and out."""

    def __init__(self, width: int, kernel: int = 4) -> None:
        super().__init__()
        self.kernel = kernel
        self.conv = nn.Conv1d(width, width, kernel)
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.conv(F.pad(x.transpose(1, 2), (self.kernel - 1, 0))).transpose(1, 2)
        return x + self.mlp(self.norm(mixed))


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.mix = CausalMix(WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mix(self.tokens(ids))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = CausalMix(WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.out(self.norm(self.mix(x)))
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
        return loss.view(targets.shape).mean(dim=1)  # one loss per sample


def build_stages(num_stages: int) -> list[nn.Module]:
    if num_stages < 2:
        raise ValueError("char_model needs at least 2 stages (an embedding stage and a head stage)")
    return [Embed(), *[CausalMix(WIDTH) for _ in range(num_stages - 2)], Head()]
