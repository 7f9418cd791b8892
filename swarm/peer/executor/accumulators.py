"""A peer's gradient sums, one per update they are meant for, and which contributions each holds.

A microbatch the trainer meant for a later update (async mode runs ahead) waits in its own
accumulator, so each update covers exactly the samples meant for it. Every accumulated request is
recorded by its contribution id (swarm.policy.ledger: stable across retries, replays and trainer
restarts): a second copy adds nothing. The accumulator of the next update is frozen while the stage
agrees on its contents and averages it; it is unfrozen if the stage is not ready after all.

The accumulator epoch changes whenever this peer drops gradients it holds but has not applied (it
caught up with its mates, or held a contribution a mate also holds): trainers replay whatever they
sent under an older epoch and do not find in the stage's ledger. Compute thread only.

Gradient convention: the gradient of the SUM over samples of the per-sample loss; an update divides
by the number of samples it covers. A sum stays finite: a request whose gradient could make it
overflow is refused (each request's gradient is finite, their sum need not be).
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from swarm.core.checks import abs_bound
from swarm.core.errors import LateContribution, NonFiniteResult, StepClosed
from swarm.policy.ledger import Held, base_id

APPLIED_IDS_REMEMBERED = 1 << 16  # contribution ids of applied updates still recognized as duplicates
ELSEWHERE_HINT_S = 10.0  # how long "a mate holds it" answers a replay: that mate may move, die or drop it


@dataclass
class Accumulated:
    """The gradient of the summed loss over `samples` samples, for update `step`, and the
    contributions (part ids) it holds."""

    grads: list[torch.Tensor] | None
    samples: int
    step: int
    held: dict[str, Held] = field(default_factory=dict)
    norm: float = 0.0  # of the mean gradient (the sum over samples), set when frozen: the outlier rule
    bound: float = 0.0  # the sum of a bound on |element| of each gradient added: no sum's element is larger


@dataclass(frozen=True)
class ReducedShard:
    """This peer's shard of a stage-wide frozen sum, reduced over the members of an agreement
    (swarm.peer.direct, reduce-scatter): float32, elements [lo, hi) of the flat parameter vector."""

    step: int
    agreement: bytes  # the digest of the agreement it was reduced over
    index: int
    count: int
    samples: int  # of the whole update (every member's)
    values: torch.Tensor


def shard_bounds(numel: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of `count` near-equal contiguous shards of a flat vector of `numel` elements."""
    return [(numel * i // count, numel * (i + 1) // count) for i in range(count)]


def flat_range(grads: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the tensors laid end to end, as one float32 CPU tensor (copies only
    that range, not the whole flat vector)."""
    parts, offset = [], 0
    for g in grads:
        n = g.numel()
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            parts.append(g.detach().reshape(-1)[a - offset : b - offset].to("cpu", torch.float32))
        offset += n
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)


@dataclass(frozen=True)
class Holder:
    """Who holds a contribution a request repeats: a peer ("" for this one) at an accumulator epoch."""

    peer_id: str
    epoch: int
    since: float = 0.0  # when this peer learned it (a mate's holding is a hint that expires)


def _locked(method):
    """Run under the accumulators' lock: the compute thread changes them, and the event loop reads a
    consistent snapshot without a hand-off to it (swarm.peer.executor.updates, `contributions`)."""

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)

    return locked


class Accumulators:
    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        self.lock = threading.RLock()  # see _locked
        # sums stay below this: their dtype holds it, and so does bfloat16 (a partial sum travels as that)
        dtypes = {p.dtype for p in params if p.is_floating_point()} | {torch.bfloat16}
        self.limit = min(torch.finfo(d).max for d in dtypes)
        self.accumulating_step = 0  # the next update to freeze; gradients for it and later go in
        self.epoch = 0
        self._open: dict[int, Accumulated] = {}
        self.frozen: Accumulated | None = None  # taken for the agreement and averaging, not yet applied
        # the frozen sum of the last update done with: a slower mate may still fetch it (swarm.peer.direct)
        self.recent_frozen: Accumulated | None = None
        self._applied: OrderedDict[str, int] = OrderedDict()  # contribution id -> step of its update
        # contributions a stage-mate holds (found when the stage agreed on an update): cid -> holder
        self._elsewhere: dict[str, Holder] = {}
        # what this peer dropped when the norm rule left it out of an update: step -> contribution ids
        self.outlier_dropped: dict[int, set[str]] = {}

    # ---- what a request repeats ----

    def holder_of(self, cid: str) -> Holder | None:
        """Where a contribution already is: this peer (open, frozen or applied), a mate, or nowhere."""
        if not cid:
            return None
        if cid in self._applied or base_id(cid) in self._applied:
            return Holder("", self.epoch)
        if self.frozen is not None and cid in self.frozen.held:
            return Holder("", self.epoch)
        if any(cid in a.held for a in self._open.values()):
            return Holder("", self.epoch)
        hint = self._elsewhere.get(cid)
        if hint is not None and time.monotonic() - hint.since > ELSEWHERE_HINT_S:
            del self._elsewhere[cid]  # that mate may have moved, died or dropped it since: accumulate it
            return None
        return hint

    def applied_step(self, cid: str) -> int | None:
        """The update that applied contribution `cid` here, if this peer remembers one."""
        step = self._applied.get(cid)
        return self._applied.get(base_id(cid)) if step is None else step

    def target_step(self, tag: int) -> int:
        """The update a backward tagged `tag` goes into: its own. One for an update this peer froze
        (the stage is agreeing on it) or applied, and that it does not hold, is refused: in the first
        case the trainer retries soon (the update may be unfrozen), in the second it is late."""
        if tag >= self.accumulating_step:
            return tag
        if self.frozen is not None and self.frozen.step == tag:
            raise StepClosed(f"update {tag} is being averaged here; retry")
        raise LateContribution(f"update {tag} is already applied here, without this contribution")

    # ---- accumulating ----

    @_locked
    def add(
        self, step: int, grads: list[torch.Tensor | None], held: dict[str, Held], largest: float | None = None
    ) -> None:
        """Add a request's (finite) gradients to update `step`'s sum; NonFiniteResult, and nothing
        added, when the sum could overflow. `largest`: a bound on their |elements| already known."""
        largest = abs_bound(grads) if largest is None else largest
        acc = self._open.get(step)
        if not math.isfinite(largest) or (acc.bound if acc is not None else 0.0) + largest > self.limit:
            raise NonFiniteResult(f"gradients this large would overflow the sum for update {step}; not accumulated")
        if acc is None:
            acc = self._open[step] = Accumulated(None, 0, step)
        if acc.grads is None:
            acc.grads = [torch.zeros_like(p) for p in self.params]
        pairs = [(buf, g) for buf, g in zip(acc.grads, grads, strict=True) if g is not None]
        if pairs:
            torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs])
        acc.bound += largest
        acc.samples += sum(h.samples for h in held.values())
        acc.held.update(held)

    def pending(self, step: int) -> Accumulated | None:
        """The gradients for update `step`, frozen for averaging or still open."""
        frozen = self.frozen
        return frozen if frozen is not None and frozen.step == step else self._open.get(step)

    def samples_for(self, step: int) -> int:
        acc = self.pending(step)
        return 0 if acc is None else acc.samples

    def get(self, step: int) -> Accumulated | None:
        """The open accumulator of `step` (tests and the look-ahead read it)."""
        return self._open.get(step)

    # ---- freezing, unfreezing, dropping ----

    @_locked
    def freeze(self) -> Accumulated:
        """Freeze the accumulator of `accumulating_step` for the stage's agreement and averaging."""
        frozen = self._open.pop(self.accumulating_step, None) or Accumulated(None, 0, self.accumulating_step)
        if frozen.grads is None:
            frozen.grads = [torch.zeros_like(p) for p in self.params]
        self.accumulating_step += 1
        self.frozen = frozen
        return frozen

    @_locked
    def unfreeze(self) -> None:
        """The stage was not ready to apply the frozen update: it takes requests again."""
        frozen, self.frozen = self.frozen, None
        if frozen is None:
            return
        self._open[frozen.step] = frozen  # nothing else came for it meanwhile: requests were refused
        self.accumulating_step = min(self.accumulating_step, frozen.step)

    @_locked
    def drop_unapplied(self, elsewhere: dict[str, Holder] | None = None) -> int:
        """Drop every gradient not yet applied and change the epoch: trainers replay what they had
        sent here. `elsewhere`: contributions a mate holds (a replay of them is a duplicate). Returns
        the samples dropped."""
        dropped = sum(a.samples for a in self._open.values()) + (self.frozen.samples if self.frozen else 0)
        if self.frozen is not None:
            self.accumulating_step = min(self.accumulating_step, self.frozen.step)
        self._open, self.frozen = {}, None
        self.epoch += 1
        now = time.monotonic()
        self._elsewhere.update({c: Holder(h.peer_id, h.epoch, now) for c, h in (elsewhere or {}).items()})
        return dropped

    @_locked
    def drop_as_outlier(self, step: int) -> int:
        """`drop_unapplied` when the norm rule left this peer out of update `step`; the ids it held
        for it are remembered and reported (a replay of them elsewhere is not evidence against its
        new holder: swarm.peer.agreement)."""
        held = set(self.frozen.held) if self.frozen is not None and self.frozen.step == step else set()
        if step in self._open:
            held |= set(self._open[step].held)
        self.outlier_dropped.setdefault(step, set()).update(held)
        return self.drop_unapplied()

    # ---- after an update ----

    @_locked
    def mark_applied(self, step: int, contributions: dict[str, Held] | None = None) -> None:
        """Update `step` is in the parameters with `contributions` (this peer's and its mates')."""
        for cid in contributions or ():
            self._applied[cid] = step
            self._applied.move_to_end(cid)
        while len(self._applied) > APPLIED_IDS_REMEMBERED:
            self._applied.popitem(last=False)
        self._elsewhere = {c: h for c, h in self._elsewhere.items() if c not in self._applied}

    @_locked
    def on_step_changed(self, step: int, drop_stale: bool) -> None:
        """The parameters are now at `step` (an update was applied, or a state loaded): gradients go
        into `step` or later; a frozen gradient of an earlier update is done with. `drop_stale`
        (a loaded state): open accumulators of updates the state already holds are dropped too."""
        self.accumulating_step = max(self.accumulating_step, step) if not drop_stale else step
        self.outlier_dropped = {s: ids for s, ids in self.outlier_dropped.items() if s >= step}
        if self.frozen is not None and self.frozen.step < step:
            self.recent_frozen, self.frozen = self.frozen, None
        if drop_stale:
            self._open = {s: a for s, a in self._open.items() if s >= step}

    def unapplied_ids(self, below: int) -> dict[str, int]:
        """Contributions held for updates before `below` (id -> step): what a catch-up must find in
        the downloaded ledger."""
        out = {cid: a.step for a in self._open.values() if a.step < below for cid in a.held}
        if self.frozen is not None and self.frozen.step < below:
            out.update({cid: self.frozen.step for cid in self.frozen.held})
        return out
