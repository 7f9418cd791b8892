"""A trainer's unit of work: a microbatch of samples meant for one step, and the Backward records it
holds for each stage until the peer that accumulated them has applied that step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor


@dataclass
class Microbatch:
    mb_id: int
    indices: list[int]
    inputs: torch.Tensor
    targets: torch.Tensor
    step_tag: int
    done: bool = False
    held: set[int] = field(default_factory=set)  # stages whose gradient is not yet applied

    @property
    def samples(self) -> int:
        return len(self.indices)


@dataclass
class HeldBackward:
    """A stage's Backward, kept until the peer that accumulated it has applied that update."""

    mb: Microbatch
    stage: int
    peer_id: str
    accumulated_step: int
    request: pb.BackwardRequest
    tensors: dict[str, WireTensor]
    replays: int = 0
