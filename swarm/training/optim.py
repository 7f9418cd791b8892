"""Optimizer, learning-rate schedule and clipping: functions of the global step only, so that every
peer of a stage applies exactly the same update."""

from __future__ import annotations

import math

import torch
from torch import nn

from swarm.training.config import OptimConfig


def lr_at(cfg: OptimConfig, step: int) -> float:
    """Linear warmup for `warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `total_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def build_optimizer(module: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW, fused (one kernel for all the parameters) where torch has that kernel: on the default
    GPT's stages a CPU step takes 1.5-1.7 ms fused against 3.5-4.6 ms one tensor at a time
    (docs/BENCHMARKS.md), and on CUDA it saves a kernel launch per parameter tensor. Elsewhere the
    single-tensor form. Every peer of a stage builds the same one, so they apply the same update; a
    peer whose parameters still drift from its stage's (another CPU's rounding) downloads them
    (swarm.peer.stepping, "diverged")."""
    params = [p for p in module.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type in FUSED_DEVICES and p.dtype in FUSED_DTYPES for p in params)
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **({"fused": True} if fused else {"foreach": False}),
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


def _steps_done(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[float]:
    """Each parameter's count of optimizer steps (0 before its first), read in one transfer: fused
    AdamW keeps them on the parameters' device, where reading each would synchronize each time."""
    held = [optimizer.state.get(p, {}).get("step") for p in params]
    present = [torch.as_tensor(t).reshape(()) for t in held if t is not None]
    if not present:
        return [0.0] * len(params)
    values = iter(torch.stack([t.to(present[0].device, torch.float64) for t in present]).tolist())
    return [0.0 if t is None else next(values) for t in held]


@torch.no_grad()
def predicted_params(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, step: int, mean_grads: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The parameters update `step` would produce from `mean_grads`, as new tensors; nothing changes.

    Async mode computes the microbatches it runs ahead at these instead of the current parameters:
    a gradient taken at the current parameters is one update stale by the time it is applied, and on
    small, fast-moving models one step of staleness costs 10-20% of validation loss (see
    scripts/staleness_effect.py). The same clipping, schedule and AdamW arithmetic as `apply_update`,
    written out so that the optimizer's state is not touched. `mean_grads` follows the optimizer's
    parameter order.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len(params) != len(mean_grads):
        raise ValueError(f"{len(mean_grads)} gradients for {len(params)} parameters")
    scale = 1.0
    if cfg.clip_norm > 0:
        norm = float(torch.nn.utils.get_total_norm(mean_grads))  # what clip_grad_norm_ computes
        scale = min(1.0, cfg.clip_norm / (norm + 1e-6))  # and its coefficient
    lr = lr_at(cfg, step)
    beta1, beta2 = cfg.beta1, cfg.beta2
    out = []
    for p, g, done in zip(params, mean_grads, _steps_done(optimizer, params), strict=True):
        g = g.to(p.device, p.dtype) * scale
        state = optimizer.state.get(p, {})
        n = done + 1
        m = g * (1 - beta1) if "exp_avg" not in state else state["exp_avg"] * beta1 + g * (1 - beta1)
        v = g * g * (1 - beta2) if "exp_avg_sq" not in state else state["exp_avg_sq"] * beta2 + g * g * (1 - beta2)
        denom = (v.sqrt() / math.sqrt(1 - beta2**n)).add_(cfg.eps)
        out.append((p * (1 - lr * cfg.weight_decay)).addcdiv_(m, denom, value=-lr / (1 - beta1**n)))
    return out


@torch.no_grad()
def expected_mean_gradient(
    optimizer: torch.optim.Optimizer, grad_sum: list[torch.Tensor] | None, samples: int, prior_samples: int
) -> list[torch.Tensor] | None:
    """A guess of the mean gradient a pending update will apply, for `predicted_params`.

    The gradients summed so far over `samples` samples, shrunk toward the optimizer's momentum (its
    bias-corrected first moment) weighted as `prior_samples` more samples: the mean of a few samples
    is noisy, and the momentum alone ignores what is already known. In the single-process oracle
    (scripts/staleness_effect.py) this prior took a quarter-batch estimate from +5.9% to +2.4% of
    fresh training's validation loss. None when there is neither a gradient nor a momentum yet.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    beta1 = optimizer.param_groups[0]["betas"][0]
    moments = None
    if prior_samples > 0 and all("exp_avg" in optimizer.state.get(p, {}) for p in params):
        steps = _steps_done(optimizer, params)
        moments = [optimizer.state[p]["exp_avg"] / (1 - beta1**n) for p, n in zip(params, steps, strict=True)]
    if samples == 0 or grad_sum is None:
        return moments
    if moments is None:
        return [g / samples for g in grad_sum]
    return [(g + m * prior_samples) / (samples + prior_samples) for g, m in zip(grad_sum, moments, strict=True)]
