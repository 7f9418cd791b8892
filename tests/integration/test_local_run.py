"""`swarm local` end to end as a user runs it: real processes, real gRPC and DHT, JSON summary."""

import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.integration.helpers import assert_all_reaped, run_args

SUMMARY_KEYS = {
    "steps",
    "samples",
    "loss_first",
    "loss_last",
    "val_loss",
    "samples_per_s",
    "wall_s",
    "peer_failures",
    "retries",
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_swarm_local_cli_trains_and_reaps_everything(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "swarm.cli",
        "local",
        "--stages",
        "2",
        "--peers-per-stage",
        "2",
        "--trainers",
        "2",
        "--steps",
        "12",
        "--json",
        "--log-dir",
        str(tmp_path / "logs"),
        *run_args(),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: set[int] = set()
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:  # record every descendant (peers, trainers, DHT processes, p2pd)
        try:
            seen.update(c.pid for c in parent.children(recursive=True))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("run id: ")
    assert lines[1].startswith("coordinator: /ip4/127.0.0.1/tcp/")
    summary = json.loads(lines[-1])
    assert SUMMARY_KEYS <= set(summary)
    assert summary["steps"] >= 12
    assert summary["samples"] >= 12 * 16
    assert summary["loss_last"] < summary["loss_first"]
    assert summary["val_loss"] is not None and summary["val_loss"] < 5.5
    assert summary["peer_failures"] == 0
    # async (the default) runs ahead: some gradients were taken at predicted parameters, predicted
    # with stage-mates' gradient sums too, and every peer shut down cleanly with its counters
    peers = summary["peers"]  # each peer's counters, from its shutdown line
    assert len(peers) == 4, "every peer reports its counters at shutdown"
    assert sum(c["predicted_samples"] for c in peers) > 0, "no microbatch ran ahead in async mode"
    assert sum(c["partials_fetched"] for c in peers) > 0, "no peer fetched a mate's partial gradient"
    assert sum(c["predictions_with_mates"] for c in peers) > 0, "no prediction used a mate's partial gradient"
    # an open swarm: the trainers' Forward/Backward went over the peers' lanes (swarm.wire.lane)
    assert all(c["lane_calls"] > 0 for c in peers), [c["lane_calls"] for c in peers]
    assert len(seen) >= 2 * 4 + 1, "coordinator, 4 peers, 2 trainers and their DHT daemons"
    assert_all_reaped([], sorted(seen))


@pytest.mark.timeout(120)
def test_bad_configuration_fails_before_starting_anything(tmp_path):
    argv = [
        sys.executable,
        "-m",
        "swarm.cli",
        "local",
        "--stages",
        "4",
        "--model",
        json.dumps({"kind": "gpt", "n_layers": 2}),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0
    assert "cannot split 2 layers into 4 stages" in proc.stderr
    argv = [sys.executable, "-m", "swarm.cli", "local", "--stage-layout", "2,0,1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0 and "at least one peer" in proc.stderr
