"""The named states of the swarm: a peer's state in its stage, why a stage applied an update, the
run's synchronization mode. String enums, so that they travel in JSON and DHT records as their
values and compare equal to them, but code compares members, never literals."""

from __future__ import annotations

from enum import StrEnum


class PeerState(StrEnum):
    """Where a peer stands in its stage, as its DHT record and Info answers say."""

    JOINING = "joining"  # building the stage, downloading its state, measuring throughput
    ONLINE = "online"  # serving and taking new work
    DRAINING = "draining"  # finishing the work it has (leaving, moving or shutting down), no new work
    OFFLINE = "offline"  # gone: left, moved away, or its record expired

    @property
    def serving(self) -> bool:
        """It still answers Forward/Backward (a draining peer finishes what it was sent)."""
        return self in (PeerState.ONLINE, PeerState.DRAINING)


class UpdateReason(StrEnum):
    """Why a peer acts on its stage's pending update now (swarm.peer.stepping)."""

    FULL = "full"  # the stage holds the global batch: average and apply
    PARTIAL = "partial"  # the stage total was stuck below the global batch: apply what it has
    BEHIND = "behind"  # a mate already applied it without this peer: download the mate's state
    DIVERGED = "diverged"  # same step, different parameters: download the reference mate's state


class SyncMode(StrEnum):
    ASYNC = "async"  # trainers run ahead of the slowest stage within a staleness bound
    EXACT = "exact"  # step t+1 starts after every stage applied step t: single-process results


class CarryOutcome(StrEnum):
    """What happened to a peer's own gradient when it caught up with a mate's update."""

    INCLUDED = "included"  # the mate's update already holds it
    CARRIED = "carried"  # one step stale: added to the next update
    DROPPED = "dropped"  # more than one step stale: discarded (counted)
