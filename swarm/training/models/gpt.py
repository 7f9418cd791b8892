"""A GPT-style decoder language model that splits into pipeline stages by layer ranges.

`GPT(config)` is the whole, unsplit model; `GPT(config, first_layer, last_layer, with_embedding,
with_head)` is one stage of it. Parameter names are the same in both (blocks keep their global index),
so stage state_dicts merge into the unsplit model's state_dict, and each parameter is initialized from
a generator seeded by (seed, its name): a stage starts with exactly the values the unsplit model has.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    d_ff: int = 512
    dropout: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPT {name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict:
        return asdict(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        # No bias: a key bias shifts every score of a query equally, so softmax cancels it and its
        # gradient is exactly zero; Adam would then move it by rounding noise alone.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.GELU(), nn.Linear(cfg.d_ff, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    """The unsplit model by default; one pipeline stage when given a layer range and ends."""

    def __init__(
        self,
        cfg: GPTConfig,
        first_layer: int = 0,
        last_layer: int | None = None,
        with_embedding: bool = True,
        with_head: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        last_layer = cfg.n_layers if last_layer is None else last_layer
        if not 0 <= first_layer <= last_layer <= cfg.n_layers:
            raise ValueError(f"layer range [{first_layer}, {last_layer}) outside [0, {cfg.n_layers})")
        self.with_embedding, self.with_head = with_embedding, with_head
        if with_embedding:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(first_layer, last_layer)})
        if with_head:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        seeded_init_(self, cfg.seed, cfg.n_layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Stage input -> stage output; with a head and targets: per-sample mean token loss [batch]."""
        if self.with_embedding:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if not self.with_head:
            return x
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
        return loss.view(targets.shape).mean(dim=1)


def param_generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))


@torch.no_grad()
def seeded_init_(module: nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 style init, each parameter from its own generator seeded by (seed, parameter name)."""
    for name, param in module.named_parameters():
        gen = param_generator(seed, name)
        if name.endswith(".bias"):
            param.zero_()
        elif ".ln" in name or name.startswith("ln_"):
            param.fill_(1.0)
        else:
            std = 0.02
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                std = 0.02 / math.sqrt(2 * n_layers)
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def split_layers(n_layers: int, num_stages: int, layer_split: list[int] | None = None) -> list[tuple[int, int]]:
    """Layer ranges per stage: the given split, or as even as possible (earlier stages get the extra)."""
    if layer_split is not None:
        if len(layer_split) != num_stages or sum(layer_split) != n_layers or min(layer_split) < 0:
            raise ValueError(
                f"layer_split {layer_split} must have {num_stages} non-negative parts summing to {n_layers}"
            )
        counts = list(layer_split)
    else:
        if num_stages > n_layers:
            raise ValueError(f"cannot split {n_layers} layers into {num_stages} stages")
        base, extra = divmod(n_layers, num_stages)
        counts = [base + (1 if i < extra else 0) for i in range(num_stages)]
    ranges, start = [], 0
    for count in counts:
        ranges.append((start, start + count))
        start += count
    return ranges


def build_gpt_stage(cfg: GPTConfig, stage: int, num_stages: int, layer_split: list[int] | None = None) -> GPT:
    first, last = split_layers(cfg.n_layers, num_stages, layer_split)[stage]
    return GPT(cfg, first, last, with_embedding=stage == 0, with_head=stage == num_stages - 1)
