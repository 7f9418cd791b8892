#!/usr/bin/env bash
# The whole test suite (lint, the import contract, unit and integration tests with real processes),
# after the same set-up as demo.sh. Extra arguments go to pytest (e.g. -m 'not slow' while iterating).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
# the dashboard's browser tests drive Debian's Chromium (playwright's own download cannot work here)
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test: installing Debian's chromium for the browser tests" >&2
    (apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; })
  else
    echo "test: the browser tests need /usr/bin/chromium: run 'apt-get install -y chromium' as root" >&2
    exit 1
  fi
fi
.venv/bin/ruff check swarm tests scripts examples
.venv/bin/ruff format --check swarm tests scripts examples
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
