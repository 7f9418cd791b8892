"""Real failures during training: SIGSTOP (then SIGCONT) of a busy peer. Training goes on, and the
stages' ledgers show every sample applied exactly once at every stage. (A SIGKILL inside a request:
tests/integration/test_exact_mode.py; SIGKILL, SIGSTOP and SIGTERM at random: the chaos tests.)"""

import re
import signal
import time

import pytest

from tests.integration.helpers import assert_ledger_exact, info, run_args, start_training, wait_for


def stopped(proc) -> bool:
    """The process is stopped (SIGSTOP): its state in /proc is T."""
    with open(f"/proc/{proc.pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigstop_then_sigcont_the_peer_catches_up(make_swarm, tmp_path):
    swarm = make_swarm(stages=3, peers_per_stage=2, trainers=1, run_args=run_args())
    swarm.start_coordinator()
    # the victim stops itself (SIGSTOP) inside the first training request it serves at step 5 or later,
    # so that a call is in flight when it stops: the trainer waits for its deadline, then retries
    fault = ["--debug-fail-at-step", "5", "--debug-fail-mode", "stop", "--debug-fail-in-request"]
    procs = [
        swarm.start_peer(stage, fault if stage == 1 and i == 0 else None, wait=False)
        for stage in range(3)
        for i in range(2)
    ]
    for proc in procs:
        proc.wait_ready(120)
    victim = procs[2]
    mate = procs[3]
    logs = str(tmp_path / "samples-{trainer}.jsonl")
    start_training(swarm, 30, ["--min-deadline", "2", "--sample-log", logs])
    wait_for(lambda: stopped(victim), 150, "the victim to stop itself in a request")
    stopped_at = int(re.search(r"fault injection: stop at step (\d+)", victim.log_tail(400)).group(1))
    before = info(mate.ready["address"]).samples_processed
    # the stage goes on without it: its work moves to the mate, which applies several updates
    wait_for(lambda: info(mate.ready["address"]).step >= stopped_at + 4, 120, "the stage to go on without it")
    victim.send_signal(signal.SIGCONT)
    # resumed, the peer sees its mate ahead, downloads its state and serves again at the stage's step
    wait_for(
        lambda: (
            (v := info(victim.ready["address"])).step >= info(mate.ready["address"]).step - 1
            and v.state == "online"
            and v.step > stopped_at
        ),
        60,
        "the resumed peer to catch up",
    )
    caught_up = time.monotonic()
    [summary] = swarm.wait_trainers(timeout=240)
    assert summary["steps"] >= 30
    assert summary["retries"] >= 1 and summary["failed_calls"] >= 1
    assert victim.ready["peer_id"] in summary["failed_peer_ids"]
    assert info(mate.ready["address"]).samples_processed > before + 16  # its work moved to the stage-mate
    v, m = info(victim.ready["address"]), info(mate.ready["address"])
    assert v.step == m.step and (v.params_sum, v.params_abs) == pytest.approx((m.params_sum, m.params_abs), rel=1e-9)
    assert time.monotonic() - caught_up < 240
    assert_ledger_exact(swarm, str(tmp_path / "samples-*.jsonl"))
