"""Whether a peer entering a stage with no mate and no checkpoint finds that the run has progressed
(then the stage has "no state" and the peer waits rather than start from its initialization). A DHT
record's step is up to a refresh old, so the live peers' Info answers count too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from swarm.peer.membership import Membership

pytestmark = pytest.mark.timeout(30)


class FakeView:
    """The peers a view knows; `poll_info` gives them the steps their Info would answer."""

    def __init__(self, live_steps: dict[str, int]) -> None:
        self.live_steps = live_steps
        self.peers = {p: SimpleNamespace(last_info_ok=0.0, step=0) for p in live_steps}
        self.polls = 0

    async def poll_info(self, stages: set[int] | None = None) -> None:
        self.polls += 1
        for peer_id, step in self.live_steps.items():
            self.peers[peer_id].last_info_ok, self.peers[peer_id].step = 1.0, step


def membership(record_steps: list[int], view: FakeView) -> Membership:
    m = Membership.__new__(Membership)
    m.run = SimpleNamespace(num_stages=2)
    entries = [SimpleNamespace(record=SimpleNamespace(step=s)) for s in record_steps]
    m.dht = SimpleNamespace(get_all_stages=lambda n: {0: entries, 1: []})
    m.view = view
    return m


def test_a_live_peer_past_step_0_counts_though_every_record_still_says_0():
    view = FakeView({"stage0-peer": 3})
    assert asyncio.run(membership([0], view)._run_has_progressed())
    assert view.polls == 1


def test_a_record_past_step_0_counts_without_asking_anyone():
    view = FakeView({"stage0-peer": 0})
    assert asyncio.run(membership([0, 5], view)._run_has_progressed())
    assert view.polls == 0


def test_a_fresh_run_has_not_progressed():
    view = FakeView({"stage0-peer": 0, "stage1-peer": 0})
    assert not asyncio.run(membership([0, 0], view)._run_has_progressed())
