"""What the compute thread works on: tasks (forward, backward, eval, or a function to run between
batches), their results, and how queued tasks are grouped into one batch."""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm.peer.executor.accumulators import Holder

FORWARD, BACKWARD, EVAL, CALL = "forward", "backward", "eval", "call"


@dataclass
class Task:
    kind: str
    inputs: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    grad_output: torch.Tensor | None = None
    request_id: str = ""  # backward: the contribution (part) id; a second copy adds nothing;
    # a training forward: the key its kept activations go under (swarm.peer.executor.activations)
    tag: int = 0  # forward and backward: the step the trainer meant this microbatch for
    digest: int = 0  # backward: the contribution's sample digest, for the ledger
    check_only: bool = False  # backward: a spot check (the input gradient only, nothing accumulated)
    forward_key: str = ""  # backward: the forward whose kept activations it may use
    reference: bool = False  # a spot check's reference answer: at the applied parameters, no look-ahead
    kept_token: int = 0  # forward: kept under this token; backward without inputs: the forward's token
    samples: int = 0  # a backward without inputs (it runs on a kept forward): its samples
    fn: Callable[[], Any] | None = None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.perf_counter)

    @property
    def size(self) -> int:
        return self.samples if self.inputs is None else int(self.inputs.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of its tensors (what it holds while queued)."""
        tensors = (self.inputs, self.targets, self.grad_output)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def batch_key(self) -> tuple:
        x, t = self.inputs, self.targets
        if x is None:  # a backward on a kept forward: batched with such backwards only
            return (self.kind, None, self.tag, self.reference)
        tag = self.tag if self.kind in (FORWARD, BACKWARD) else 0
        shapes = (tuple(x.shape[1:]), None if t is None else tuple(t.shape[1:]))
        return (self.kind, x.dtype, *shapes, tag, self.reference)


@dataclass
class ForwardResult:
    output: torch.Tensor | None  # None on the last stage
    loss: torch.Tensor | None  # per-sample losses on the last stage
    compute_s: float
    params_step: int = 0  # the updates applied to the parameters it was computed at
    predicted: bool = False  # ... with the async look-ahead's predicted update on top
    kept: bool = False  # its activations are kept here for its backward


@dataclass
class BackwardResult:
    grad_input: torch.Tensor | None
    loss: torch.Tensor | None
    accumulated_step: int
    duplicate: bool
    compute_s: float
    epoch: int = 0  # this peer's accumulator epoch
    holder: Holder | None = None  # a duplicate: who holds the contribution ("" peer id: this peer)
    params_step: int = 0  # as in ForwardResult
    predicted: bool = False


def take_batch(queue: collections.deque[Task], max_samples: int, is_duplicate: Callable[[Task], bool]) -> list[Task]:
    """Pop the first task and every later one that can share its batch: same kind, shapes and target
    update, within `max_samples`. A function call or a duplicate Backward runs alone, and nothing
    queued after a function call joins a batch ahead of it (a call may freeze or apply an update: a
    request submitted after it must see its effect)."""
    first = queue.popleft()
    if first.kind == CALL or is_duplicate(first):
        return [first]
    batch, total, key = [first], first.size, first.batch_key()
    keep: list[Task] = []
    while queue and total < max_samples:
        if queue[0].kind == CALL:
            break
        task = queue.popleft()
        fits = total + task.size <= max_samples
        if fits and task.batch_key() == key and not is_duplicate(task):
            batch.append(task)
            total += task.size
        else:
            keep.append(task)
    queue.extendleft(reversed(keep))
    return batch
