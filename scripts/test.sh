#!/usr/bin/env bash
# The whole test suite (unit + integration with real processes), after the same set-up as demo.sh.
# Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
.venv/bin/ruff check swarm tests scripts
exec .venv/bin/python -m pytest "$@"
