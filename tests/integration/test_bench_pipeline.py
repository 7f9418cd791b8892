"""scripts/bench_pipeline.py --quick keeps working: it runs end to end and its JSON line is complete.

No timing assertions: the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEYS = (
    "swarm_samples_per_s",
    "torch_gpipe_samples_per_s",
    "torch_1f1b_samples_per_s",
    "ratio_vs_torch_best",
    "swarm_exact_samples_per_s",
    "ratio_exact_vs_torch_best",
    "swarm_2x_samples_per_s",
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_pipeline_quick_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_pipeline.py"), "--quick", "--json", "--log-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,  # generous: other work may share the machine
    )
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    lines = proc.stdout.strip().splitlines()
    assert "samples/s" in proc.stdout  # the readable table comes first
    record = json.loads(lines[-1])
    for key in KEYS:
        value = record[key]
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (key, value)
    config = record["config"]
    assert config["stages"] == 3 and config["global_batch"] % config["microbatch"] == 0
    assert config["microbatches"] == config["global_batch"] // config["microbatch"]
    assert record["machine"]["cpu_count"] >= 1 and record["machine"]["platform"]
    assert record["swarm_sync"] in ("exact", "async")
    # the process count on each side, stated: the swarm side runs peers, a trainer, a coordinator and
    # their DHT and p2pd processes (at least 3 peers + trainer + coordinator)
    processes = record["processes"]
    # in exact mode a backward runs at the parameters of its forward: most find their kept activations
    assert record["activation_hit_rate"]["exact_1x"] > 0.5, record["activation_hit_rate"]
    assert processes["torch"] == 3 and processes["swarm_exact_1x"] >= 5 and processes["swarm_exact_2x"] >= 8
    # where a call's time goes, from the trainer: every kind and stage of a 3-stage pipeline was
    # called, and an answer never comes sooner than the time it spent at the peer, nor that sooner
    # than the compute the peer reports for it
    row = next(r for r in record["rows"] if r["name"] == "swarm exact 1/stage")
    calls = row["extra"]["call_ms"]
    assert {"forward 0", "forward 1", "backward 0", "backward 1", "backward 2"} <= set(calls), calls
    for key, c in calls.items():
        assert c["calls"] > 0 and 0 < c["compute_ms"] <= c["peer_ms"] <= c["elapsed_ms"], (key, c)
