"""Your own model from the command line: the example module (copied outside this package) trains through
`swarm local --custom-model ... --custom-model-path DIR`, with its own dataset factory, to a loss drop."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_example_model_trains_through_the_cli(tmp_path):
    models = tmp_path / "my_models"
    models.mkdir()
    shutil.copy(ROOT / "examples" / "tiny_mlp.py", models / "tiny_mlp.py")
    argv = [
        sys.executable, "-m", "swarm.cli", "local", "--custom-model", "tiny_mlp:build_stages",
        "--custom-model-path", str(models), "--stages", "2", "--peers-per-stage", "1", "--steps", "30",
        "--lr", "1e-2", "--json", "--log-dir", str(tmp_path / "logs"),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=360)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print({k: result[k] for k in ("loss_first", "loss_last", "val_loss", "samples_per_s")})
    assert result["steps"] == 30
    assert result["loss_last"] < 0.75 * result["loss_first"], result
    assert result["val_loss"] < result["loss_first"]
