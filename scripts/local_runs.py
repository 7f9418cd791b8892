"""Shared by the benchmark scripts: one `swarm local --json` run as a subprocess, its summary."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def swarm_local_json(args: list[str], timeout: float = 3600, log_dir: str | None = None) -> dict:
    """Run `swarm local --json ARGS` (logs in `log_dir`, else a temporary folder) and return its
    last-line summary."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = log_dir or tmp
        proc = subprocess.run(
            [sys.executable, "-m", "swarm.cli", "local", "--json", "--log-dir", logs, *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"swarm local {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
