"""Stage-mates agree on what an update contains before they average it.

Each peer of a stage holds the gradients of the contributions routed to it. When the stage holds
the global batch for update t, every peer freezes its accumulator and fetches its live mates'
frozen lists (GetContributions). The update is averaged only if, together, they hold every
contribution of step t exactly once: no contribution held by two mates (a backward retried on a
mate after its deadline while the first peer still accumulated it; a paused peer whose work the
trainers replayed elsewhere) and exactly the global batch of samples. A contribution held twice is
counted once by a deterministic rule: the mate with the smallest peer id keeps it; every other
holder of a duplicate drops all its unapplied gradients (they cannot be taken apart) and the
trainers replay them, the duplicate excepted. Otherwise the peers unfreeze and wait.

A robust rule keeps a peer's corrupted gradients out of the update: each frozen list says the norm
of the peer's mean gradient, and with three or more members holding samples, a member whose norm is
more than OUTLIER_FACTOR times the median of the others' is left out of the update (its
contributions are dropped by it and replayed by the trainers on its mates). Honest mean gradients
of a few samples differ by small factors (sampling noise); a scaled or garbage gradient does not.
One honest microbatch can stand out too (a loss spike): the left-out peer reports what it dropped,
and the member that then holds a replay of it is not left out for it (a liar is left out again with
its next, different contributions).

The same module serves the ledger (GetLedger; swarm.cluster.ledger fetches it).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from swarm.cluster.ledger import DEFAULT_LEDGER_STEPS
from swarm.peer.executor import StageExecutor
from swarm.peer.executor.accumulators import Holder
from swarm.peer.executor.updates import HeldSnapshot
from swarm.policy.ledger import Held
from swarm.wire.blob import blob_chunks
from swarm.wire.client import StageClient
from swarm.wire.protocol import pb

MAX_LEDGER_STEPS = 4096
OUTLIER_FACTOR = 8.0  # a member's gradient norm above this times the others' median is left out
OUTLIER_MIN_MEMBERS = 3  # with two, neither can be told the liar


def contributions_response(peer_id: str, snap: HeldSnapshot) -> pb.ContributionsResponse:
    response = pb.ContributionsResponse(
        peer_id=peer_id, step=snap.step, frozen=snap.frozen, epoch=snap.epoch, applied_step=snap.applied_step,
        grad_norm=snap.grad_norm,
    )  # fmt: skip
    for cid, held in snap.held.items():
        response.contributions.add(id=cid, samples=held.samples, digest=held.digest)
    response.outlier_dropped.extend(sorted(snap.outlier_dropped))
    return response


def snapshot_of(response: pb.ContributionsResponse) -> HeldSnapshot:
    held = {c.id: Held(int(c.samples), int(c.digest)) for c in response.contributions}
    return HeldSnapshot(
        int(response.step), bool(response.frozen), int(response.epoch), held, int(response.applied_step),
        float(response.grad_norm), frozenset(response.outlier_dropped),
    )  # fmt: skip


async def fetch_contributions(
    client: StageClient, run_id: str, stage: int, step: int, timeout_s: float
) -> HeldSnapshot:
    request = pb.ContributionsRequest(run_id=run_id, stage=stage, step=step)
    return snapshot_of(await client.get_contributions(request, timeout=timeout_s))


@dataclass
class Agreement:
    """What the frozen lists of the participating peers say about update `step`."""

    step: int
    members: list[tuple[str, int]]  # (peer id, epoch) of every participant, sorted by id
    union: dict[str, Held]  # every contribution (part) held, once
    samples: int  # of the union
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # part id -> peers holding it
    not_frozen: list[str] = field(default_factory=list)  # participants still taking requests for it
    outliers: dict[str, float] = field(default_factory=dict)  # left out by the norm rule: id -> norm / median
    samples_by_member: dict[str, int] = field(default_factory=dict)  # what each member's frozen sum holds

    def ready(self, global_batch: int) -> bool:
        return not self.duplicates and not self.not_frozen and not self.outliers and self.samples == global_batch

    def must_drop(self, peer_id: str) -> dict[str, Holder] | None:
        """If `peer_id` loses a duplicate (another holder has a smaller id): the contributions it
        must treat as held elsewhere (id -> keeper), else None."""
        epochs = dict(self.members)
        elsewhere = {}
        for cid, holders in self.duplicates.items():
            keeper = min(holders)
            if peer_id in holders and peer_id != keeper:
                elsewhere[cid] = Holder(keeper, epochs[keeper])
        return elsewhere or None


def gradient_outliers(lists: dict[str, HeldSnapshot], factor: float = OUTLIER_FACTOR) -> dict[str, float]:
    """Members whose mean-gradient norm is above `factor` times the median of the others' (among
    frozen members holding samples, when there are at least OUTLIER_MIN_MEMBERS): id -> the ratio."""
    norms = {p: s.grad_norm for p, s in lists.items() if s.frozen and s.held and math.isfinite(s.grad_norm)}
    if len(norms) < OUTLIER_MIN_MEMBERS:
        return {}
    out = {}
    for peer_id, norm in norms.items():
        median = statistics.median(n for p, n in norms.items() if p != peer_id)
        if median > 0 and norm > factor * median and not _holds_a_replayed_outlier(peer_id, lists):
            out[peer_id] = norm / median
    return out


def _holds_a_replayed_outlier(peer_id: str, lists: dict[str, HeldSnapshot]) -> bool:
    """Whether `peer_id` holds a contribution that another member dropped when it was left out of
    this update: the outlying norm followed the data (an honest heavy-tailed microbatch, replayed
    here), not the peer. A peer's own report does not count (a liar could claim anything it holds)."""
    held = lists[peer_id].held
    return any(not held.keys().isdisjoint(s.outlier_dropped) for p, s in lists.items() if p != peer_id)


def agree(step: int, lists: dict[str, HeldSnapshot]) -> Agreement:
    """The agreement of the peers whose frozen lists for `step` are in `lists` (peer id -> list).
    Outliers (`gradient_outliers`) are left out: not members, their contributions not counted."""
    outliers = gradient_outliers(lists)
    lists = {p: s for p, s in lists.items() if p not in outliers}
    holders: dict[str, list[str]] = defaultdict(list)
    union: dict[str, Held] = {}
    for peer_id, snap in sorted(lists.items()):
        for cid, held in snap.held.items():
            holders[cid].append(peer_id)
            union.setdefault(cid, held)
    return Agreement(
        step=step,
        members=sorted((p, s.epoch) for p, s in lists.items()),
        union=union,
        samples=sum(h.samples for h in union.values()),
        duplicates={c: sorted(h) for c, h in holders.items() if len(h) > 1},
        not_frozen=sorted(p for p, s in lists.items() if not s.frozen),
        outliers=outliers,
        samples_by_member={p: sum(h.samples for h in s.held.values()) for p, s in lists.items()},
    )


# ---- the ledger over gRPC ----


async def ledger_chunks(executor: StageExecutor, request: pb.LedgerRequest):
    """GetLedger's messages: the entries from `from_step` on, as JSON lines (no checksum: TCP's)."""
    # max_steps <= 0 asks for the default (a negative one would slice from the end: no cap at all)
    limit = min(MAX_LEDGER_STEPS, request.max_steps if request.max_steps > 0 else DEFAULT_LEDGER_STEPS)
    entries = executor.ledger.entries(int(request.from_step), limit)
    data = "".join(e.to_json() + "\n" for e in entries).encode()
    async for chunk in blob_chunks(data, checksum=False, entries=len(entries), stage=executor.built.stage):
        yield chunk


__all__ = ["Agreement", "agree", "contributions_response", "fetch_contributions"]
