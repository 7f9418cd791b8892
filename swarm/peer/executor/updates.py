"""The state side of a stage's executor: freezing, agreeing on and applying updates, the ledger
entry of each, state snapshots and loading, stage-mates' partial sums for the look-ahead. These run
on the compute thread (through `StageExecutor.call`), between batches, so that an update never races
a backward; `StageExecutor` (swarm.peer.executor.compute) mixes them in."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from swarm.core.checks import gradient_norm
from swarm.peer.executor.accumulators import Accumulated, Holder, ReducedShard, flat_range, shard_bounds
from swarm.peer.ledger import LEDGER_STATE_STEPS
from swarm.policy.ledger import Held, LedgerEntry, base_id, merge_parts
from swarm.training.optim import apply_update
from swarm.training.state import clone_tensors, parameter_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldSnapshot:
    step: int
    frozen: bool
    epoch: int
    held: dict[str, Held]
    applied_step: int
    grad_norm: float = 0.0  # of its frozen mean gradient (0 while not frozen)
    outlier_dropped: frozenset[str] = frozenset()  # what it dropped when the norm rule left it out


@dataclass
class ExecutorCounters:
    samples_processed: int = 0  # samples back-propagated (all of them: the two below included)
    duplicate_samples: int = 0  # ... of contributions already held here or by a mate (nothing added)
    check_samples: int = 0  # ... of trainers' spot checks (the input gradient only)
    samples_discarded: int = 0  # unapplied gradients dropped (the trainers replay them)
    contributions_included: int = 0  # held contributions a downloaded update already contained
    averaging_rounds: int = 0
    sharded_rounds: int = 0  # ... of them averaged by reduce-scatter (swarm.peer.direct: 3 or more members)
    compute_seconds: float = 0.0


class StageUpdates:
    """Mixed into StageExecutor; the attributes it uses are set there."""

    # ---- look-ahead: stage-mates' partial sums (compute thread) ----

    def partial_gradient(self, step: int) -> Accumulated | None:
        """This peer's own gradient sum for the pending update `step` as one flat bfloat16 tensor
        (`grads` holds just that), for its stage-mates' look-ahead; None when `step` is not pending
        here."""
        if step != self.step:
            return None
        acc = self.acc.pending(step)
        if acc is None or acc.grads is None or acc.samples == 0:
            return Accumulated(None, 0, step)
        flat = torch.cat([g.detach().reshape(-1).to(torch.bfloat16) for g in acc.grads]).cpu()
        return Accumulated([flat], acc.samples, step)

    def frozen_gradient(self, step: int, shard: tuple[int, int] | None = None) -> tuple[Accumulated, int] | None:
        """(this peer's frozen sum for update `step` as one flat float32 tensor, the accumulator
        epoch) for its mates' direct averaging (swarm.peer.direct): the frozen one while this peer
        averages that update itself (`averaging_step`: as in an all-reduce, every member takes part,
        so a peer frozen but busy elsewhere, e.g. catching up, is no member), or the one of the
        update just applied (a slower mate may still be fetching it); None otherwise. With `shard`
        (index, count), only that shard of the flat sum (`shard_bounds`)."""
        acc = self.acc
        with acc.lock:  # any thread: the compute thread changes the accumulators under this lock
            taking_part = acc.frozen if self.averaging_step == step else None
            frozen = next((f for f in (taking_part, acc.recent_frozen) if f is not None and f.step == step), None)
            if frozen is None:
                return None
            if frozen.grads is None or frozen.samples == 0:
                return Accumulated(None, 0, step), acc.epoch
            numel = sum(g.numel() for g in frozen.grads)
            lo, hi = (0, numel) if shard is None else shard_bounds(numel, shard[1])[shard[0]]
            return Accumulated([flat_range(frozen.grads, lo, hi)], frozen.samples, step), acc.epoch

    def keep_reduced(self, shard: ReducedShard) -> None:
        """Keep this peer's latest reduced shard for its mates' fetches (swarm.peer.direct; any thread)."""
        self.reduced_shard = shard

    def set_mate_partial(self, peer_id: str, partial: Accumulated) -> bool:
        """Keep a stage-mate's gradient sum for the pending update (the caller checked shapes and
        finiteness); a sum for another step than the pending one is ignored."""
        return self.lookahead.set_mate_partial(peer_id, partial, self.step)

    def contributions(self, step: int) -> HeldSnapshot:
        """What this peer holds for update `step`, and whether it froze it (the stage's agreement). Any
        thread: a consistent snapshot under the accumulators' lock, without waiting for the compute
        thread's batch (in async mode that wait was most of the agreement's 26 ms)."""
        with self.acc.lock:
            acc = self.acc.pending(step)
            frozen = self.acc.frozen is not None and self.acc.frozen.step == step
            norm = self.acc.frozen.norm if frozen else 0.0
            dropped = frozenset(self.acc.outlier_dropped.get(step, ()))
            held = dict(acc.held) if acc else {}
            return HeldSnapshot(step, frozen, self.acc.epoch, held, self.step, norm, dropped)

    def work_counters(self) -> dict[str, int]:
        """The samples it computed (all, duplicates, spot checks): kept per stage when a peer moves."""
        c = self.counters
        return {"samples_processed": c.samples_processed, "duplicate_samples": c.duplicate_samples,
                "check_samples": c.check_samples}  # fmt: skip

    # ---- updates and state (call these through `call`, or from the compute thread) ----

    def take_accumulated(self) -> Accumulated:
        """Freeze the accumulator of the next update; new gradients go into the one after. Its mean
        gradient's norm is what the stage's outlier rule compares (swarm.peer.agreement)."""
        with self.acc.lock:  # readers see it frozen with its norm, never without
            frozen = self.acc.freeze()
            lie = self.lie  # a debug liar (swarm peer --debug-lie gradients)
            if lie is not None and lie.mode == "gradients" and frozen.step >= lie.from_step and frozen.samples:
                for g in frozen.grads:
                    g.mul_(1.0 + lie.scale)
            frozen.norm = gradient_norm(frozen.grads) / max(1, frozen.samples)
            return frozen

    def unfreeze(self) -> None:
        """The stage was not ready to apply the frozen update after all: take requests for it again."""
        self.acc.unfreeze()

    def drop_unapplied(self, elsewhere: dict[str, Holder] | None = None, outlier_step: int | None = None) -> int:
        """Drop the gradients this peer holds but has not applied (the trainers replay them); the
        accumulator epoch changes. `outlier_step`: the norm rule left this peer out of that update
        (what it held for it is reported: swarm.peer.agreement). Returns the samples dropped."""
        if outlier_step is not None:
            dropped = self.acc.drop_as_outlier(outlier_step)
        else:
            dropped = self.acc.drop_unapplied(elsewhere)
        self.counters.samples_discarded += dropped
        self.lookahead.reset()
        return dropped

    def _step_changed(self, drop_stale: bool) -> None:
        """After the parameters changed to those of `self.step` (an update, or a loaded state)."""
        self.acc.on_step_changed(self.step, drop_stale)
        self.lookahead.reset()
        self.activations.clear()  # kept forwards hold graphs of the old parameters
        self.fingerprint = self.compute_fingerprint()

    def apply_mean_gradient(
        self,
        mean_grads: list[torch.Tensor],
        step: int,
        members: list[tuple[str, int]] | None = None,
        contributions: dict[str, Held] | None = None,
    ) -> float:
        """Apply the update for `step` from the mean gradient, averaged across the stage from the
        gradients of `members` ((peer id, accumulator epoch)) that together hold `contributions`
        (part ids; default: this peer's frozen ones). It goes into the ledger."""
        if step != self.step:
            raise RuntimeError(f"update for step {step} applied at step {self.step}")
        for p, g in zip(self.params, mean_grads, strict=True):
            p.grad = g.to(p.device)
        norm = apply_update(self.optimizer, self.optim_cfg, step)
        for p in self.params:
            p.grad = None
        with self.acc.lock:  # the step and the accumulators change together for readers
            self.step = step + 1
            if contributions is None:
                frozen = self.acc.pending(step)
                contributions = dict(frozen.held) if frozen is not None else {}
            entry = LedgerEntry(self.built.stage, step, merge_parts(contributions), list(members or []), time.time())
            self.ledger.record(entry)
            self.acc.mark_applied(step, contributions)
            self._step_changed(drop_stale=False)
        return norm

    def local_step(self) -> tuple[int, float]:
        """Freeze and apply an update from this peer's own gradients (no averaging)."""
        frozen = self.take_accumulated()
        mean = [g / max(1, frozen.samples) for g in frozen.grads]
        return frozen.samples, self.apply_mean_gradient(mean, frozen.step)

    def compute_fingerprint(self) -> tuple[int, float, float]:
        """(step, sum, sum of |p|): replaced as one tuple so that readers on other threads see a
        consistent (step, values)."""
        return (self.step, *parameter_fingerprint(self.params))

    def state_dict(self) -> dict:
        """Parameters, optimizer state and step: what a joining peer downloads."""
        return {
            "step": self.step,
            "model": {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()},
            "optimizer": clone_tensors(self.optimizer.state_dict()),
            "ledger": self.ledger.to_state(),
        }

    def load_state_dict(self, state: dict) -> int:
        """Load a stage's state (a mate's, or a checkpoint). Gradients this peer holds for updates
        the state already holds must be in those updates (its ledger says which): they are, or
        every unapplied gradient is dropped and replayed by the trainers. Returns the samples dropped."""
        with self.acc.lock:  # the step and the accumulators change together for readers
            return self._load_state_dict(state)

    def _load_state_dict(self, state: dict) -> int:
        held = self.acc.unapplied_ids(below=int(state["step"]))
        # the moments under this peer's own hyperparameters (the run's; the learning rate is set at
        # every update), copied: a loaded tensor may share memory with another or be a broadcast view
        groups = self.optimizer.state_dict()["param_groups"]
        self.optimizer.load_state_dict({"state": clone_tensors(state["optimizer"]["state"]), "param_groups": groups})
        self.module.load_state_dict(state["model"])
        self.step = int(state["step"])
        ledger = state.get("ledger")
        if isinstance(ledger, list):
            self.ledger.load_state([line for line in ledger if isinstance(line, str)])
        for entry in self.ledger.entries(max(0, self.step - LEDGER_STATE_STEPS)):
            self.acc.mark_applied(entry.step, entry.contributions)  # a repeat of these adds nothing
        missing = [cid for cid, step in held.items() if not self._in_ledger(cid, step)]
        self.counters.contributions_included += len(held) - len(missing)
        dropped = 0
        if missing:
            logger.warning(
                "%d contribution(s) this peer held are not in the downloaded updates: dropping every unapplied "
                "gradient for the trainers to replay",
                len(missing),
            )
            dropped = self.drop_unapplied()
        # gradients for updates the loaded state already holds are in it (or were just dropped)
        self._step_changed(drop_stale=True)
        return dropped

    def _in_ledger(self, cid: str, step: int) -> bool:
        entry = self.ledger.get(step)
        return entry is not None and base_id(cid) in entry.contributions
