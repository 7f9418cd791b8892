"""Every fuzz target, by name, in the order a run goes through them."""

from __future__ import annotations

from tests.fuzz import blob_targets, handler_targets, record_targets, state_targets, wire_targets
from tests.fuzz.harness import Target

TARGETS: dict[str, Target] = {
    t.name: t
    for module in (wire_targets, handler_targets, record_targets, state_targets, blob_targets)
    for t in module.TARGETS
}


def split_cases(total: int, names: list[str]) -> dict[str, int]:
    """`total` cases over `names` by their targets' weights (every target at least one)."""
    weights = {n: TARGETS[n].weight for n in names}
    whole = sum(weights.values())
    shares = {n: max(1, int(total * w / whole)) for n, w in weights.items()}
    shares[names[0]] += max(0, total - sum(shares.values()))
    return shares
