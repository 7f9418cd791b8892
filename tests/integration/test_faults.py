"""Real failures during training: SIGKILL and SIGSTOP of a busy peer. Training goes on."""

import signal

import pytest

from tests.integration.helpers import info, run_args, start_training, wait_for


def busiest_peer(swarm, stage: int):
    """The peer of `stage` that has run the most backward work (the one the wiring prefers)."""
    peers = [p for p in swarm.peers if p.ready["stage"] == stage and p.alive()]
    return max(peers, key=lambda p: info(p.ready["address"]).samples_processed)


def assert_no_microbatch_lost(summary: dict) -> None:
    accounted = (
        summary["microbatches_completed"]
        + summary["microbatches_requeued"]
        + summary["microbatches_rejected"]
        + summary["microbatches_cancelled"]
    )
    assert summary["microbatches_started"] == accounted, summary
    assert summary["microbatches_rejected"] == 0


@pytest.mark.timeout(300)
def test_sigkill_of_a_busy_peer_costs_retries_not_the_run(make_swarm):
    # every call streamed part by part, so that the streamed path meets a real failure too
    swarm = make_swarm(stages=3, peers_per_stage=2, trainers=1, run_args=run_args())
    swarm.start()
    progress = start_training(swarm, steps=24, trainer_args=["--stream-threshold-kb", "0"])
    progress.wait_step(6, timeout=120)
    victim = busiest_peer(swarm, stage=1)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    [summary] = swarm.wait_trainers(timeout=240)
    assert summary["steps"] >= 24
    assert summary["peer_failures"] >= 1
    assert victim.ready["peer_id"] in summary["failed_peer_ids"]
    assert summary["retries"] >= 1
    assert_no_microbatch_lost(summary)
    survivor = next(p for p in swarm.peers if p.ready["stage"] == 1 and p is not victim)
    assert info(survivor.ready["address"]).step >= 20  # the stage-mate carried the stage on


@pytest.mark.timeout(300)
def test_sigstop_of_a_busy_peer_fires_deadlines_and_moves_work(make_swarm):
    swarm = make_swarm(stages=3, peers_per_stage=2, trainers=1, run_args=run_args())
    swarm.start()
    progress = start_training(swarm, steps=20, trainer_args=["--min-deadline", "2"])
    progress.wait_step(5, timeout=120)
    victim = busiest_peer(swarm, stage=1)
    mate = next(p for p in swarm.peers if p.ready["stage"] == 1 and p is not victim)
    before = info(mate.ready["address"]).samples_processed
    victim.send_signal(signal.SIGSTOP)
    try:
        [summary] = swarm.wait_trainers(timeout=240)
    finally:
        victim.send_signal(signal.SIGCONT)
    assert summary["steps"] >= 20
    assert summary["retries"] >= 1 and summary["failed_calls"] >= 1
    assert victim.ready["peer_id"] in summary["failed_peer_ids"]
    assert info(mate.ready["address"]).samples_processed > before + 16  # its work moved to the stage-mate
    assert_no_microbatch_lost(summary)
    wait_for(lambda: victim.alive(), 5, "the stopped peer to still exist")  # it was paused, not killed
