"""Checking a Forward/Backward request against the stage before any compute: targets, streamed
tensor headers, output gradients. Every failure is a typed error (swarm.core.errors) that the
server maps to a gRPC status."""

from __future__ import annotations

import math

import torch

from swarm.core.checks import all_finite
from swarm.peer.serving import Limits
from swarm.training.models import StageSchema
from swarm.wire import codec
from swarm.wire.codec import WireError
from swarm.wire.protocol import pb


def decode_targets(msg, schema: StageSchema, batch: int, limits: Limits) -> torch.Tensor | None:
    """The last stage's targets, checked against its schema and the input's batch."""
    if not schema.is_last:
        return None
    if not msg.HasField("targets"):
        raise WireError("the last stage needs targets")
    targets = codec.decode(msg.targets, limits.max_numel)
    schema.targets.check(targets, "targets", limits.max_batch)
    if targets.shape[0] != batch:
        raise WireError(f"targets batch {targets.shape[0]} differs from input batch {batch}")
    return targets


def check_header(header: pb.Tensor, what: str, schema: StageSchema, limits: Limits) -> int:
    """Check a streamed tensor's header against the stage's schema before any part arrives; returns
    its batch size."""
    if header.dtype not in codec.DTYPES or header.codec not in codec.CODEC_LABELS:
        raise WireError(f"{what}: unknown dtype {header.dtype!r} or codec {header.codec}")
    shape = tuple(int(d) for d in header.shape)
    if not shape or not 1 <= shape[0] <= limits.max_batch:
        raise WireError(f"{what} has shape {list(shape)}: batch must be in 1..{limits.max_batch}")
    if any(d < 1 for d in shape) or math.prod(shape) > limits.max_numel:
        raise WireError(f"{what} has shape {list(shape)}: at most {limits.max_numel} elements, each dim >= 1")
    if what == "input":
        schema.input.check_shape(shape, codec.DTYPES[header.dtype], what, limits.max_batch)
    return shape[0]


def input_left_out(msg, schema: StageSchema, limits: Limits) -> bool:
    """Whether a Backward leaves its input out for the activations this peer kept of its forward
    (BackwardRequest.kept_token); a malformed one is refused here, before any part is read."""
    if not msg.kept_token:
        return False
    if msg.HasField("input"):
        raise WireError("a backward with kept_token leaves its input out; this one carries it")
    if schema.is_last:
        raise WireError("the last stage keeps no forward activations: send the input")
    if not msg.forward_id:
        raise WireError("a backward with kept_token must name its forward (forward_id)")
    if not 1 <= msg.num_samples <= limits.max_batch:
        raise WireError(f"num_samples {msg.num_samples} is not within 1..{limits.max_batch}")
    return True


def check_grad_output(grad: torch.Tensor | None, batch: int) -> torch.Tensor:
    if grad is None:
        raise WireError("backward on a non-last stage needs grad_output")
    if not grad.dtype.is_floating_point:
        raise WireError(f"grad_output must be a float tensor, got {grad.dtype}")
    if grad.shape[0] != batch:
        raise WireError(f"grad_output batch {grad.shape[0]} differs from input batch {batch}")
    if not all_finite(grad):
        raise WireError("grad_output contains NaN or infinity")
    return grad.float()
