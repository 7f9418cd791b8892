"""The forward's saved activations, kept for the backward of the same microbatch on the same peer.

Without it a peer's backward is stateless: it recomputes the forward from the stage input the
request carries (forward + forward + backward: x1.33 the compute). With it, a training forward at
the current parameters keeps its autograd graph, keyed by the trainer's forward request id; the
backward that names that id (BackwardRequest.forward_id) and lands on this peer runs the backward
pass on the kept graph; if the forward's answer gave its token (ForwardResponse.kept_token), the trainer
leaves that backward's input out and the token stands in for the input's equality check. Anything else
recomputes as before: a backward on another peer (the first
one died, or the wiring chose a mate), an entry evicted for the budget or its age, or one dropped
because the parameters changed (an update, a loaded state) since its forward.

Bounded: entries are kept least-recently-used within `budget_bytes` (the saved tensors' bytes,
parameters not counted) and for at most `ttl_s` seconds. Only the compute thread touches it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch


@dataclass
class Kept:
    inputs: torch.Tensor  # the stage input, a leaf that requires grad when it is a float tensor
    output: torch.Tensor  # the forward's output, its graph attached
    nbytes: int
    at: float
    token: int = 0  # given to the forward's requester: a backward naming it may leave the input out


@dataclass
class ActivationCounters:
    activation_hits: int = 0  # backwards that used a kept forward
    activation_misses: int = 0  # backwards that named a forward this peer no longer (or never) kept
    activations_kept: int = 0  # forwards whose graph was kept
    activations_evicted: int = 0  # dropped for the budget or their age before their backward came
    activations_dropped: int = 0  # dropped because the parameters changed


def saved_bytes(params: list[torch.Tensor]):
    """A context manager that counts the bytes autograd saves for backward, parameters excluded
    (they are kept anyway), and the list that receives the count."""
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in param_storages:
            total[0] += t.numel() * t.element_size()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


class ActivationCache:
    def __init__(self, budget_bytes: int, ttl_s: float = 60.0) -> None:
        self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
        self.counters = ActivationCounters()
        self._kept: collections.OrderedDict[str, Kept] = collections.OrderedDict()
        self._bytes = 0

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, key: str, inputs: torch.Tensor, output: torch.Tensor, nbytes: int, token: int = 0) -> bool:
        """Keep a forward's graph; False (nothing kept) when it alone is over the budget."""
        if not key or nbytes > self.budget_bytes:
            return False
        old = self._kept.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        now = time.monotonic()
        self._expire(now)
        while self._kept and self._bytes + nbytes > self.budget_bytes:
            self._evict_oldest()
        self._kept[key] = Kept(inputs, output, nbytes, now, token)
        self._bytes += nbytes
        self.counters.activations_kept += 1
        return True

    def take(self, key: str, inputs: torch.Tensor | None, token: int = 0, samples: int = 0) -> Kept | None:
        """The kept forward of `key` (removed: a graph runs backward once) if its input is the one
        given, or (no input given) if it was kept under `token` for `samples` samples; counts a hit or
        a miss."""
        self._expire(time.monotonic())
        kept = self._kept.get(key) if key else None
        if kept is not None and not self._matches(kept, inputs, token, samples):
            kept = None  # another forward's data or token: the entry stays for its own backward
        if kept is not None:
            del self._kept[key]
            self._bytes -= kept.nbytes
        if kept is None:
            self.counters.activation_misses += 1
        else:
            self.counters.activation_hits += 1
        return kept

    @staticmethod
    def _matches(kept: Kept, inputs: torch.Tensor | None, token: int, samples: int) -> bool:
        """The backward's input is the kept forward's: equal, or (left out) named by its token, the
        sample counts equal."""
        if inputs is None:
            return bool(token) and kept.token == token and kept.inputs.shape[0] == samples
        same = kept.inputs.shape == inputs.shape and kept.inputs.dtype == inputs.dtype
        return same and torch.equal(kept.inputs.detach(), inputs.to(kept.inputs.device))

    def clear(self) -> None:
        """The parameters changed: every kept graph is stale."""
        self.counters.activations_dropped += len(self._kept)
        self._kept.clear()
        self._bytes = 0

    def _evict_oldest(self) -> None:
        _, kept = self._kept.popitem(last=False)
        self._bytes -= kept.nbytes
        self.counters.activations_evicted += 1

    def _expire(self, now: float) -> None:
        while self._kept and now - next(iter(self._kept.values())).at > self.ttl_s:
            self._evict_oldest()
