"""Where a stage's step time goes: the update timeline each peer keeps (swarm.peer.stepping) and
reports in its counters (scripts/bench_pipeline.py sums it over the peers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class UpdateTimeline:
    """Where a stage's step time goes, summed over the updates this peer applied: from the previous
    update to this one (`interval_s`), of which the update itself took freezing (and reading the
    accusations), waiting for mates (stragglers: a mate that had not frozen it yet, or had not begun
    averaging it), agreeing with the mates on what it holds, the all-reduce, and applying it; the
    rest of the interval is compute and waiting for samples. Failed rounds' time is counted apart."""

    updates: int = 0
    interval_s: float = 0.0  # summed over updates after the first (each needs a previous one)
    intervals: int = 0
    freeze_s: float = 0.0
    wait_mates_s: float = 0.0
    agree_s: float = 0.0
    allreduce_s: float = 0.0
    apply_s: float = 0.0
    failed_round_s: float = 0.0
    last_applied: float | None = None

    def record(
        self,
        start: float,
        frozen: float,
        agreed: float,
        averaged: float,
        applied: float,
        waited: float = 0.0,
        straggler: float = 0.0,
    ) -> None:
        """`waited`: of the agreement, waiting for mates to freeze; `straggler`: of the averaging,
        waiting for a mate to begin it. Both count as waiting for mates, not as averaging."""
        self.updates += 1
        self.freeze_s += frozen - start
        self.wait_mates_s += waited + straggler
        self.agree_s += agreed - frozen - waited
        self.allreduce_s += averaged - agreed - straggler
        self.apply_s += applied - averaged
        if self.last_applied is not None:
            self.interval_s += applied - self.last_applied
            self.intervals += 1
        self.last_applied = applied

    def as_dict(self) -> dict[str, float | int]:
        out = {k: v for k, v in asdict(self).items() if k != "last_applied"}
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}
