"""The synthetic swarm behind the dashboard's tests, demos and benchmarks."""

from __future__ import annotations

import asyncio
import json

import pytest

from swarm.dashboard.source import LIVE_STATES, PEER_STATES, REQUIRED_KEYS, check_state
from swarm.dashboard.synthetic import MAX_HISTORY, SyntheticSource, synthetic_state

pytestmark = pytest.mark.timeout(60)


def test_synthetic_state_is_realistic_and_deterministic():
    doc = synthetic_state()
    check_state(doc)
    assert set(REQUIRED_KEYS) <= set(doc)
    assert json.dumps(doc) == json.dumps(synthetic_state()) != json.dumps(synthetic_state(seed=1))
    peers = [p for s in doc["stages"] for p in s["peers"]]
    assert len(peers) == 1000 and len(doc["stages"]) == 8 and len({p["peer_id"] for p in peers}) == 1000
    assert {p["state"] for p in peers} == set(PEER_STATES)
    sizes = [len(s["peers"]) for s in doc["stages"]]
    assert min(sizes) < max(sizes) / 5, "one stage is thin"
    assert doc["bottleneck"] == sizes.index(min(sizes)) and doc["healthy"] is True
    assert len(doc["history"]["time"]) == 500 and len(doc["events"]) == 200
    assert {len(v) for v in doc["history"].values()} == {500}
    losses = [v for v in doc["history"]["loss"] if v is not None]
    assert losses[0] > losses[-1] + 1.0 and None in doc["history"]["val_loss"]
    assert synthetic_state(t=100.0)["step"] > doc["step"]


@pytest.mark.parametrize(("peers", "stages"), [(1, 1), (3, 3), (10, 1), (7, 4), (40, 4)])
def test_small_swarms(peers, stages):
    doc = synthetic_state(peers, stages)
    assert sum(len(s["peers"]) for s in doc["stages"]) == peers and len(doc["stages"]) == stages


def test_source_evolves_and_kill_turns_a_peer_dead():
    now = [0.0]
    source = SyntheticSource(peers=30, stages=3, death_rate=0.0, clock=lambda: now[0])
    first = asyncio.run(source.snapshot())
    now[0] = 10.0
    second = asyncio.run(source.snapshot())
    assert second["step"] > first["step"] and second["time"] == pytest.approx(first["time"] + 10.0)
    assert len(second["history"]["time"]) == len(first["history"]["time"]) + 1
    victim = next(p for s in second["stages"] for p in s["peers"] if p["state"] == "online")
    source.kill(victim["peer_id"])
    now[0] = 15.0
    third = asyncio.run(source.snapshot())
    peer = next(p for s in third["stages"] for p in s["peers"] if p["peer_id"] == victim["peer_id"])
    assert peer["state"] == "dead" and peer["last_seen_s"] == pytest.approx(5.0, abs=0.01)
    assert third["events"][-1]["kind"] == "failure" and third["events"][-1]["peer_id"] == victim["peer_id"]
    assert third["events_total"]["failure"] == second["events_total"].get("failure", 0) + 1
    stage = next(s for s in third["stages"] if any(p["peer_id"] == victim["peer_id"] for p in s["peers"]))
    assert stage["live_peers"] == sum(p["state"] in LIVE_STATES for p in stage["peers"])
    assert victim["state"] == "online", "snapshots are copies, not views of the source's state"
    with pytest.raises(KeyError):
        source.kill("no-such-peer")


def test_killing_a_stage_makes_the_swarm_unhealthy():
    source = SyntheticSource(peers=12, stages=3, death_rate=0.0)
    doc = asyncio.run(source.snapshot())
    thin = doc["stages"][doc["bottleneck"]]
    for peer in thin["peers"]:
        source.kill(peer["peer_id"])
    doc = asyncio.run(source.snapshot())
    assert doc["healthy"] is False and doc["stages"][thin["stage"]]["live_peers"] == 0


def test_random_deaths_history_cap_and_error():
    now = [0.0]
    source = SyntheticSource(peers=100, stages=4, death_rate=1000.0, clock=lambda: now[0])
    dead_before = sum(p["state"] == "dead" for s in synthetic_state(100, 4)["stages"] for p in s["peers"])
    for _ in range(MAX_HISTORY - 400):
        now[0] += 1.0
        doc = asyncio.run(source.snapshot())
    assert len(doc["history"]["time"]) == MAX_HISTORY and len(doc["events"]) == 200
    assert sum(p["state"] == "dead" for s in doc["stages"] for p in s["peers"]) > dead_before
    assert all(s["live_peers"] >= 1 for s in doc["stages"]), "random deaths never take a stage's last peer"
    source.error = "collector down"
    with pytest.raises(RuntimeError, match="collector down"):
        asyncio.run(source.snapshot())
