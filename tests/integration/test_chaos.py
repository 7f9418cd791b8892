"""A quick `swarm chaos` run as a user runs it: every fault kind once (the swarm in a network lab, so
that a peer's link can be cut), then the ledger check: no sample lost or counted twice at any stage,
and no process left behind."""

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from swarm.chaos.config import FAULT_KINDS
from swarm.chaos.observer import LocalObserver
from swarm.core.states import PeerState
from swarm.netlab import naming
from tests.integration.helpers import TINY_GPT, run_args


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_chaos_run_keeps_every_sample_exactly_once(tmp_path):
    argv = [
        sys.executable, "-m", "swarm.cli", "chaos", "--minutes", "1", "--baseline-minutes", "0.1",
        "--schedule", "cut,kill,stop,term,join,trainer,coordinator", "--json", "--log-dir", str(tmp_path / "logs"),
        "--netns", "lan",
        "--model", json.dumps(TINY_GPT), "--global-batch", "16", "--microbatch", "4",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["faults"] == {k: 1 for k in FAULT_KINDS}
    assert result["lost"] == 0 and result["duplicated"] == 0 and result["misplaced"] == 0, result
    assert result["ledger_ok"] and result["steps"] >= 20 and result["samples"] >= 20 * 16
    assert result["leftover_processes"] == 0
    assert result["throughput_ratio"] > 0 and result["val_loss"] is not None
    # the peers' --ledger-dir files alone hold every stage's updates (the check does not depend on
    # reaching live peers at the end)
    from swarm.ledger import read_ledger_dir

    entries = read_ledger_dir(tmp_path / "logs" / "ledger")
    assert {e.stage for e in entries} == {0, 1, 2} and max(e.step for e in entries) >= result["steps"] - 1

    assert_cut_peer_caught_up(proc.stderr, tmp_path / "logs")


def assert_cut_peer_caught_up(chaos_log: str, logs) -> None:
    """The peer whose link was cut applied updates again after the link was mended (unless a later
    fault took it: then its log ends there)."""
    cut = re.search(r"chaos (\d\d:\d\d:\d\d) .* link of (\S+) cut for ([\d.]+) s", chaos_log)
    assert cut, chaos_log[-3000:]
    at, victim, pause = cut[1], cut[2], float(cut[3])
    if re.search(rf"(SIGKILL|SIGTERM) {victim}\b", chaos_log):
        return
    h, m, s = map(int, at.split(":"))
    mended = h * 3600 + m * 60 + s + pause + 1
    applied_after = []
    for line in (logs / f"{victim}.log").read_text().splitlines():
        found = re.match(r"(\d\d):(\d\d):(\d\d) .*applied update (\d+)", line)
        if found and int(found[1]) * 3600 + int(found[2]) * 60 + int(found[3]) > mended:
            applied_after.append(int(found[4]))
    if len(applied_after) < 3:  # what the victim did from the cut on, for the reader of a failure
        h0 = h * 3600 + m * 60 + s
        since = [
            line[:240]
            for line in (logs / f"{victim}.log").read_text().splitlines()
            if (t := re.match(r"(\d\d):(\d\d):(\d\d) ", line)) and int(t[1]) * 3600 + int(t[2]) * 60 + int(t[3]) >= h0
        ]
        detail = "\n".join(since[-60:])
        raise AssertionError(
            f"{victim} applied {applied_after} after its link was mended ({at} + {pause:.1f} s); chaos log:\n"
            f"{chaos_log[-2500:]}\n{victim}'s log from the cut on:\n{detail}"
        )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_stops_a_chaos_run_and_removes_its_lab(tmp_path):
    """SIGTERM (a supervisor, a closed terminal) stops a chaos run as Ctrl-C does: every process of it
    is stopped and its network lab removed."""
    run_id = f"chaos-term-{os.getpid()}"
    argv = [
        sys.executable, "-m", "swarm.cli", "chaos", "--minutes", "1", "--baseline-minutes", "0.25", "--netns", "lan",
        "--run-id", run_id, "--log-dir", str(tmp_path / "logs"), "--model", json.dumps(TINY_GPT),
        "--global-batch", "16", "--microbatch", "4",
    ]  # fmt: skip
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:  # the swarm is up and training: its fault-free phase began
            if "fault-free phase" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
        assert "interrupted" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # its own lab is gone (other tests' labs may come and go meanwhile)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert naming.lab_prefix(naming.lab_key(run_id)) not in after, after
    left = [
        p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"]) if run_id in " ".join(p.info["cmdline"] or ())
    ]
    assert not left, f"processes of the run left behind: {left}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_observer_without_a_lab_sees_each_peers_stage(make_swarm):
    """Outside a network lab `swarm chaos` asks the peers from its own process (LocalObserver)."""
    swarm = make_swarm(stages=2, peers_per_stage=1, trainers=1, run_args=run_args())
    swarm.start()
    addresses = [p.ready["address"] for p in swarm.peers]
    answers = LocalObserver().probe([*addresses, "127.0.0.1:9"])  # nothing listens on port 9
    assert answers == {addresses[0]: (0, PeerState.ONLINE), addresses[1]: (1, PeerState.ONLINE), "127.0.0.1:9": None}
