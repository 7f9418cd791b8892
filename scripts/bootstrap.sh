#!/usr/bin/env bash
# Set up .venv on a fresh machine: torch's CPU build first (so pip does not pull a multi-GB CUDA
# build), then the project with its test extras. Re-running is cheap: it skips what is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1; then PY="$cand"; break; fi
  done
fi
[ -n "$PY" ] || { echo "bootstrap: no python3 found" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
STAMP=.venv/.swarm-installed
WANT="$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "bootstrap: installing torch==2.13.0 (CPU build) and the project into .venv" >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
  echo "$WANT" > "$STAMP"
fi
.venv/bin/python -m swarm.wire.codegen >/dev/null
