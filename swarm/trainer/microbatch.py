"""A trainer's unit of work: a microbatch of samples meant for one step, and the Backward records it
holds for each stage until the peer that accumulated them has applied that step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor


@dataclass
class Microbatch:
    cid: str  # its contribution id, TRAINER/STEP/OFFSET (swarm.policy.ledger): the same in every retry
    indices: list[int]
    inputs: torch.Tensor
    targets: torch.Tensor
    step_tag: int
    digest: int  # of its sample indices
    done: bool = False
    held: set[int] = field(default_factory=set)  # stages whose gradient is not yet applied

    @property
    def samples(self) -> int:
        return len(self.indices)


@dataclass
class HeldBackward:
    """A stage's Backward, kept until the stage's ledger shows it in an applied update. `holder` and
    `epoch`: the peer that holds its gradient and that peer's accumulator epoch (if either changes
    before the update is applied, the gradient is gone and the record is replayed)."""

    mb: Microbatch
    stage: int
    holder: str
    epoch: int
    accumulated_step: int
    request: pb.BackwardRequest
    tensors: dict[str, WireTensor]
    replays: int = 0
