"""Cheap checks on tensors that every request and update goes through."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """True if no element is NaN or infinite.

    A float sum propagates NaN and infinity, and on one thread costs a twentieth of
    `isfinite(t).all()` (1.1 ms against 26 ms for 16 MiB here, where that check was the largest
    item of a peer's request path). Only a non-finite sum, which a huge but finite tensor could also
    overflow to, takes the exact check."""
    if not tensor.dtype.is_floating_point or tensor.numel() == 0:
        return True
    if bool(torch.isfinite(tensor.sum(dtype=torch.float32))):
        return True
    return bool(torch.isfinite(tensor).all())


def abs_bound(tensors: Iterable[torch.Tensor | None]) -> float:
    """An upper bound on every |element| of the float tensors given (0.0 for none); NaN or infinity
    when an element is. The largest of their L2 norms, in one fused pass (an exact max |x| per tensor,
    `vector_norm(t, inf)`, took 16x longer: 8% of a GPT stage's compute thread); only when a norm
    overflows does the exact maximum decide."""
    ts = [t for t in tensors if t is not None and t.numel() and t.dtype.is_floating_point]
    if not ts:
        return 0.0
    bound = max(float(n) for n in torch._foreach_norm(ts, 2.0))
    if math.isfinite(bound):
        return bound
    exact = [float(torch.linalg.vector_norm(t, float("inf"))) for t in ts]
    return math.nan if any(math.isnan(e) for e in exact) else max(exact)


def gradient_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of all the tensors together (one fused pass, one synchronisation)."""
    ts = [t for t in tensors if t.numel()]
    if not ts:
        return 0.0
    return float(torch.stack([n.double() for n in torch._foreach_norm(ts, 2.0)]).norm())
