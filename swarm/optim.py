"""Optimizer, learning-rate schedule and clipping: functions of the global step only, so that every
peer of a stage applies exactly the same update."""

from __future__ import annotations

import math

import torch
from torch import nn

from swarm.config import OptimConfig


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Linear warmup for `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `total_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def build_optimizer(module: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in module.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )


def apply_update(optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int) -> float:
    """Set the step's learning rate, clip the (already averaged) gradient, step. Returns the grad norm."""
    lr = lr_at(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if cfg.clip_norm > 0:
        norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm))
    else:
        norm = float(torch.norm(torch.stack([p.grad.norm() for p in params]))) if params else 0.0
    optimizer.step()
    return norm
