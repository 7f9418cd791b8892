"""Whether a peer entering a stage with no mate and no checkpoint finds that the run has progressed
(then the stage has "no state" and the peer waits rather than start from its initialization). A DHT
record's step is up to a refresh old, so a few live peers of the other stages are asked too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarm.cluster.view import PeerStatus, SwarmView
from swarm.core.states import PeerState
from swarm.peer.membership import PROGRESS_POLLS, Membership
from swarm.policy.wiring import PeerLoad
from swarm.wire.protocol import pb

pytestmark = pytest.mark.timeout(30)


class _Client:
    """A peer's Info: its step, or no answer (`None`: a dead peer)."""

    def __init__(self, peer_id: str, step: int | None) -> None:
        self.peer_id, self.step, self.asked = peer_id, step, 0

    def set_lane(self, port: int) -> None:
        pass

    async def info(self, timeout, wait_for_step=0, wait_s=0.0, accused=(), seen=None):
        self.asked += 1
        if self.step is None:
            raise ConnectionError("no answer")
        return pb.InfoResponse(peer_id=self.peer_id, stage=0, state="online", step=self.step)


class _Clients:
    def __init__(self, clients: dict[str, _Client]) -> None:
        self.clients = clients

    def get(self, address: str) -> _Client:
        return self.clients[address]


def view_of(steps: dict[str, tuple[int, int | None, PeerState]]) -> tuple[SwarmView, dict[str, _Client]]:
    """A real view of peers id -> (stage, the step its Info answers or None, its record's state)."""
    clients = {p: _Client(p, step) for p, (_, step, _) in steps.items()}
    view = SwarmView(dht=None, num_stages=3, clients=_Clients(clients))
    for p, (stage, _, state) in steps.items():
        view.peers[p] = PeerStatus(PeerLoad(p, stage, p), record_state=state)
    return view, clients


def membership(record_steps: list[int], view: SwarmView, stage: int = 1) -> Membership:
    m = Membership.__new__(Membership)
    m.run = SimpleNamespace(num_stages=3)
    entries = [SimpleNamespace(record=SimpleNamespace(step=s)) for s in record_steps]
    m.dht = SimpleNamespace(get_all_stages=lambda n: {0: entries, 1: [], 2: []})
    m.view = view
    m.runtime = SimpleNamespace(stage=stage)
    return m


def test_a_live_peer_past_step_0_counts_though_every_record_still_says_0():
    view, clients = view_of({"a": (0, None, PeerState.ONLINE), "b": (0, 3, PeerState.ONLINE)})
    assert asyncio.run(membership([0, 0], view)._run_has_progressed())
    assert clients["b"].asked == 1


def test_a_record_past_step_0_counts_without_asking_anyone():
    view, clients = view_of({"a": (0, 0, PeerState.ONLINE)})
    assert asyncio.run(membership([0, 5], view)._run_has_progressed())
    assert clients["a"].asked == 0


def test_a_fresh_run_has_not_progressed_and_the_peer_asks_a_few_others_only():
    peers = {f"p{i}": (i % 2 * 2, 0, PeerState.ONLINE) for i in range(3 * PROGRESS_POLLS)}
    peers["mate"] = (1, 7, PeerState.ONLINE)  # of the peer's own stage: not asked (no mate answered before)
    peers["gone"] = (0, 9, PeerState.OFFLINE)  # an offline record is not asked
    view, clients = view_of(peers)
    assert not asyncio.run(membership([0, 0], view)._run_has_progressed())
    assert sum(c.asked for c in clients.values()) == PROGRESS_POLLS
    assert clients["mate"].asked == 0 and clients["gone"].asked == 0
