"""What a stage does off the normal path is never silent: a stage short of its global batch (its
trainer died) waits, says so, and goes on exactly once the trainer is back; a stage that lost every
peer and checkpoint has "no state" and waits, unless a peer is started with --allow-reinit."""

import signal

import pytest

from tests.integration.helpers import assert_ledger_exact, info, run_args, start_training, wait_for


def events_of(read, kind: str) -> list[dict]:
    return [e for e in read()["events"] if e.get("event") == kind]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_trainer_stalls_the_stage_visibly_and_its_restart_completes_the_step(make_swarm, read_status, tmp_path):
    swarm = make_swarm(stages=2, peers_per_stage=1, trainers=2, run_args=run_args(), peer_args=["--stall-report", "2"])
    swarm.start()
    read = read_status(swarm)
    logs = str(tmp_path / "samples-{trainer}.jsonl")
    progress = start_training(swarm, 30, ["--sample-log", logs])
    progress.wait_step(4, timeout=120)
    swarm.trainers[1].send_signal(signal.SIGKILL, group=True)
    swarm.trainers[1].wait(timeout=10)
    stalled = wait_for(lambda: events_of(read, "stalled"), 60, "a stalled event")
    step = info(swarm.peers[0].ready["address"]).step
    assert stalled[0]["of"] == 16 and stalled[0]["samples"] < 16  # it holds part of a step: no partial step
    st = read()
    assert any(s["fallbacks"].get("stalled") for s in st["stages"])  # `swarm status` shows it
    assert info(swarm.peers[0].ready["address"]).step == step  # nothing applied meanwhile
    swarm.restart_trainer(1)  # the same index: it completes what it had started
    summaries = swarm.wait_trainers(timeout=240)
    assert all(s["steps"] >= 30 for s in summaries)
    assert any(s["stage_fallbacks"].get("stalled") for s in summaries)  # and the trainers' summaries
    assert_ledger_exact(swarm, str(tmp_path / "samples-*.jsonl"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stage_with_no_state_left_waits_unless_reinit_is_allowed(make_swarm, read_status):
    swarm = make_swarm(stages=2, peers_per_stage=1, trainers=1, run_args=run_args())
    swarm.start()
    read = read_status(swarm)
    progress = start_training(swarm, 1000)
    progress.wait_step(3, timeout=120)
    only = next(p for p in swarm.peers if p.ready["stage"] == 1)
    only.send_signal(signal.SIGKILL)
    only.wait(timeout=10)
    fresh = swarm.start_peer(1, ["--no-rebalance"], wait=False)

    def no_state_note():
        return [n for n in read()["stages"][1]["notes"] if "no state" in n]

    wait_for(no_state_note, 120, "`swarm status` to show that stage 1 has no state")
    assert events_of(read, "no_state")
    fresh.send_signal(signal.SIGKILL)
    reinit = swarm.start_peer(1, ["--no-rebalance", "--allow-reinit"])  # the operator's explicit choice
    assert reinit.ready["step"] == 0
    wait_for(lambda: events_of(read, "reinit"), 60, "the reinit event")
    progress.wait_step(progress.latest() + 3, timeout=120)  # training goes on
