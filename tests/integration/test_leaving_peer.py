"""A peer that is leaving its stage answers UNAVAILABLE, and the trainer retries elsewhere: no sample
is dropped. (A stopped executor once mapped to INVALID_ARGUMENT by its message: the trainer took it
for a rejected microbatch and dropped its samples.)"""

import pytest

from tests.integration.helpers import run_args


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_request_into_a_leaving_peer_gets_unavailable_and_no_sample_is_dropped(make_swarm):
    swarm = make_swarm(stages=2, peers_per_stage=2, trainers=1, steps=16, run_args=run_args())
    swarm.start_coordinator()
    # this peer's compute stops at step 4, in the first request it serves from then on, while it still
    # looks online (the moment a peer starts to leave, before its record says so); 2 s later it moves
    # to stage 1
    fault = ["--debug-fail-at-step", "4", "--debug-fail-mode", "leave", "--debug-fail-in-request"]
    leaving = swarm.start_peer(0, ["--no-rebalance", *fault])
    others = [swarm.start_peer(stage, ["--no-rebalance"], wait=False) for stage in (0, 1, 1)]
    for proc in others:
        proc.wait_ready(120)
    swarm.start_trainers()
    [summary] = swarm.wait_trainers(timeout=240)
    assert summary["steps"] >= 16
    codes = summary["failed_calls_by_code"]
    assert codes.get("UNAVAILABLE", 0) >= 1, codes  # requests did reach the leaving peer
    assert "INVALID_ARGUMENT" not in codes, codes
    assert summary["microbatches_rejected"] == 0  # nothing was given up
    assert summary["loss_last"] < summary["loss_first"]
    swarm.stop()
    assert leaving.counters is not None and leaving.counters["stage"] == 1  # it did move on
