"""The ledger: which samples each applied update contains, and the check that every sample entered
every stage's parameters exactly once.

A contribution is one microbatch of one trainer, named "TRAINER/STEP/OFFSET": trainer `t1`'s samples
at offset 8 of its share of step 12 are `t1/12/8`, whatever happens to the calls that carry them
(retries, replays on a stage-mate, the trainer's restart). Each peer records, per applied update, the
contributions it holds (with their sample counts and an order-independent digest of their sample
indices) and the stage-mates whose gradients it averaged; trainers record what they assigned.
`check` compares the two: per stage, every assigned contribution of the steps the stage has applied
must be in exactly one update, the one of its step (exact mode: the same set of samples in step t at
every stage follows).

Pure logic, no I/O: peers, trainers, `swarm ledger` and the tests use it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

MASK64 = (1 << 64) - 1


def contribution_id(trainer: str, step: int, offset: int) -> str:
    return f"{trainer}/{step}/{offset}"


def base_id(cid: str) -> str:
    """The contribution a part of a streamed request belongs to ("t0/3/8#1" -> "t0/3/8")."""
    return cid.split("#", 1)[0]


def step_of(cid: str) -> int:
    """The step a contribution was assigned to; -1 for an id that is not a contribution id."""
    try:
        return int(base_id(cid).split("/")[1])
    except (IndexError, ValueError):
        return -1


def _mix(x: int) -> int:
    """splitmix64: spreads sample indices over 64 bits so that their sum identifies the set."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def samples_digest(indices: Iterable[int]) -> int:
    """An order-independent 64-bit digest of sample indices (a sum of mixed values: combining two
    contributions' digests adds them)."""
    return sum(_mix(int(i)) for i in indices) & MASK64


@dataclass(frozen=True)
class Held:
    """What an update (or a peer's accumulator) holds of one contribution."""

    samples: int
    digest: int


@dataclass
class LedgerEntry:
    """One applied update of one stage."""

    stage: int
    step: int
    contributions: dict[str, Held]  # contribution id -> samples and digest (parts merged)
    members: list[tuple[str, int]] = field(default_factory=list)  # (peer id, accumulator epoch) averaged
    time: float = 0.0

    @property
    def samples(self) -> int:
        return sum(h.samples for h in self.contributions.values())

    def to_json(self) -> str:
        return json.dumps(
            {
                "stage": self.stage,
                "step": self.step,
                "time": round(self.time, 3),
                "members": [list(m) for m in self.members],
                "contributions": {c: [h.samples, h.digest] for c, h in sorted(self.contributions.items())},
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> LedgerEntry:
        """An entry from one line of `to_json`; a line that is not one raises ValueError, KeyError,
        TypeError or IndexError (what the readers of other peers' ledgers and of ledger files catch)."""
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError(f"a ledger entry is a JSON object, not {type(d).__name__}")
            held, members = d["contributions"], d.get("members", [])
            if not isinstance(held, dict) or not isinstance(members, list):
                raise TypeError("a ledger entry's contributions are an object and its members a list")
            if not all(isinstance(v, list) and len(v) == 2 for v in (*held.values(), *members)):
                raise TypeError("a ledger entry's contributions and members are [a, b] pairs")
            contributions = {str(c): Held(int(v[0]), int(v[1])) for c, v in held.items()}
            members = [(str(m[0]), int(m[1])) for m in members]
            return cls(int(d["stage"]), int(d["step"]), contributions, members, float(d.get("time", 0.0)))
        except (RecursionError, OverflowError) as e:  # JSON nested too deep; int() of an infinite number
            raise ValueError(f"malformed ledger entry: {type(e).__name__}") from None


def merge_parts(parts: dict[str, Held]) -> dict[str, Held]:
    """Contributions from their parts ("t0/3/8#0", "t0/3/8#1" -> "t0/3/8"): samples add; every part
    carries its contribution's digest."""
    merged: dict[str, list[int]] = {}
    for cid, held in parts.items():
        m = merged.setdefault(base_id(cid), [0, held.digest])
        m[0] += held.samples
    return {c: Held(s, d) for c, (s, d) in merged.items()}


@dataclass(frozen=True)
class Assignment:
    """A contribution as its trainer assigned it (`digest` None: from the plan, not the trainer's
    log, so the sample indices are not checked)."""

    cid: str
    step: int
    samples: int
    digest: int | None


def planned(shares: list[int], microbatch: int, steps: int) -> list[Assignment]:
    """The contributions trainers with these shares of the global batch assign for steps
    0..steps-1 (swarm.policy.pacing splits a share into microbatches in order)."""
    out = []
    for index, share in enumerate(shares):
        for step in range(steps):
            for offset in range(0, share, microbatch):
                cid = contribution_id(f"t{index}", step, offset)
                out.append(Assignment(cid, step, min(microbatch, share - offset), None))
    return out


@dataclass
class LedgerReport:
    through_step: int  # updates 0 .. through_step - 1 are checked at every stage
    checked: int  # contributions checked, per stage
    checked_samples: int = 0  # their samples
    lost: list[tuple[int, int, str]] = field(default_factory=list)  # (stage, step, contribution)
    duplicated: list[tuple[int, int, str]] = field(default_factory=list)  # (stage, step of an extra copy, cid)
    misplaced: list[tuple[int, int, str]] = field(default_factory=list)  # (stage, step applied in, cid)
    mismatched: list[tuple[int, int, str]] = field(default_factory=list)  # samples or digest differ
    unknown: list[tuple[int, int, str]] = field(default_factory=list)  # applied, never assigned
    inconsistent: list[tuple[int, int]] = field(default_factory=list)  # peers of a stage disagree on a step
    missing_steps: list[tuple[int, int]] = field(default_factory=list)  # (stage, step) with no ledger entry

    @property
    def ok(self) -> bool:
        return not (
            self.lost or self.duplicated or self.misplaced or self.mismatched or self.inconsistent or self.missing_steps
        )

    @property
    def passed(self) -> bool:
        """Nothing wrong, and something was checked: a check of nothing is no pass."""
        return self.ok and self.checked > 0

    def counts(self) -> dict[str, int]:
        return {
            "lost": len(self.lost),
            "duplicated": len(self.duplicated),
            "misplaced": len(self.misplaced),
            "mismatched": len(self.mismatched),
            "unknown": len(self.unknown),
            "inconsistent": len(self.inconsistent),
            "missing_steps": len(self.missing_steps),
        }


def stage_updates(entries: Iterable[LedgerEntry], report: LedgerReport) -> dict[int, dict[int, LedgerEntry]]:
    """stage -> step -> the update, from every peer's entries (peers of a stage must agree)."""
    out: dict[int, dict[int, LedgerEntry]] = defaultdict(dict)
    for e in entries:
        seen = out[e.stage].get(e.step)
        if seen is None:
            out[e.stage][e.step] = e
        elif seen.contributions != e.contributions and (e.stage, e.step) not in report.inconsistent:
            report.inconsistent.append((e.stage, e.step))
    return out


def check(entries: Iterable[LedgerEntry], assignments: Iterable[Assignment], num_stages: int) -> LedgerReport:
    """Every assigned contribution of the steps every stage has applied, at every stage: in exactly
    one update, the one of its step, with the samples and digest its trainer assigned."""
    assigned = {a.cid: a for a in assignments}
    report = LedgerReport(through_step=0, checked=0)
    updates = stage_updates(entries, report)
    applied = [max(updates[k], default=-1) + 1 for k in range(num_stages)]
    report.through_step = min(applied) if applied else 0
    wanted = {c: a for c, a in assigned.items() if a.step < report.through_step}
    report.checked = len(wanted)
    report.checked_samples = sum(a.samples for a in wanted.values())
    for stage in range(num_stages):
        where: dict[str, list[int]] = defaultdict(list)
        for step in range(report.through_step):
            update = updates[stage].get(step)
            if update is None:
                report.missing_steps.append((stage, step))
                continue
            for cid, held in update.contributions.items():
                where[cid].append(step)
                a = assigned.get(cid)
                if a is None:
                    report.unknown.append((stage, step, cid))
                elif a.samples != held.samples or (a.digest is not None and a.digest != held.digest):
                    report.mismatched.append((stage, step, cid))
        for cid, a in wanted.items():
            steps = where.get(cid, [])
            if not steps:
                report.lost.append((stage, a.step, cid))
            for extra in steps[1:]:
                report.duplicated.append((stage, extra, cid))
            if steps and steps[0] != a.step:
                report.misplaced.append((stage, steps[0], cid))
    return report


def format_report(report: LedgerReport, limit: int = 20) -> str:
    lines = [
        f"ledger: {report.checked} contributions of steps 0..{report.through_step - 1} checked at every stage: "
        + ", ".join(f"{k} {v}" for k, v in report.counts().items())
    ]
    for name in ("lost", "duplicated", "misplaced", "mismatched", "unknown"):
        rows = getattr(report, name)
        for stage, step, cid in rows[:limit]:
            lines.append(f"  {name:<10} stage {stage} step {step}: {cid}")
        if len(rows) > limit:
            lines.append(f"  ... and {len(rows) - limit} more {name}")
    for stage, step in report.inconsistent[:limit]:
        lines.append(f"  inconsistent stage {stage} step {step}: its peers recorded different contributions")
    for stage, step in report.missing_steps[:limit]:
        lines.append(f"  missing     stage {stage} step {step}: no peer recorded this update")
    return "\n".join(lines)
