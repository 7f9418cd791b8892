"""A trainer's unit of work: a microbatch of samples meant for one step, and the Backward records it
holds for each stage until the peer that accumulated them has applied that step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from swarm.wire.protocol import pb
from swarm.wire.tensors import WireTensor

MAX_REJECTIONS = 3  # async: a microbatch a peer refused as invalid runs again this many times, then is dropped


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
    rejections: int = 0  # times a peer refused it as invalid (async mode runs it again, a few times)

    def again(self, rejected: bool = False) -> Microbatch:
        """The same samples for the same step, to run again from the start (stages that already hold
        its gradient answer a duplicate: its id is the same)."""
        return Microbatch(
            self.cid, self.indices, self.inputs, self.targets, self.step_tag, self.digest,
            rejections=self.rejections + int(rejected),
        )  # fmt: skip

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
    answered: float = field(default_factory=time.monotonic)  # when the holder's answer arrived
