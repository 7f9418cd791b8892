"""docker/compose.yaml, unchanged, run for real without Docker (`swarm compose-up`): a coordinator, 6 peer
replicas and a trainer, each in its own network namespace with the service's environment and the shared
volume, train; the trainer exits 0 with its summary; everything is stopped and removed. Root only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.netlab import check_available, naming

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_compose_file_trains(tmp_path):
    check_available()
    shared_existed = os.path.exists("/shared")
    argv = [sys.executable, "-m", "swarm.cli", "compose-up", "-f", str(ROOT / "docker" / "compose.yaml"),
            "--exit-code-from", "trainer", "--workdir", str(tmp_path), "--env", "STEPS=3"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=540, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = result["summaries"]["swarm-trainer-1"]
    assert result["exited"] == "swarm-trainer-1" and summary["steps"] == 3
    assert summary["loss_last"] < summary["loss_first"]
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == ["swarm-coordinator-1.log", *[f"swarm-peer-{i}.log" for i in range(1, 7)], "swarm-trainer-1.log"]
    maddrs = (tmp_path / "volumes" / "swarm-shared" / "coordinator.maddrs").read_text()
    assert maddrs.startswith("/ip4/100.6") and "/tcp/7001/p2p/" in maddrs  # hostname -i: the namespace's IP
    assert list((tmp_path / "volumes" / "swarm-shared" / "checkpoints").glob("stage*/step*.pt"))
    coordinator_log = (tmp_path / "logs" / "swarm-coordinator-1.log").read_text()
    assert "run compose: join with" in coordinator_log  # ${RUN_ID:-compose}, then "$$RUN_ID" in the shell
    assert "serving stage" in (tmp_path / "logs" / "swarm-peer-3.log").read_text()
    # this run's lab is gone (only its own: other tests' labs may come and go meanwhile)
    after = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert len(result["lab"]) == 6 and naming.lab_prefix(result["lab"]) not in after
    assert os.path.exists("/shared") == shared_existed  # a mount point made for the run is gone
