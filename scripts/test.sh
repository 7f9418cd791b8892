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
# two workers (pytest-xdist): a test mostly waits on its swarm's processes (the machine is about half busy
# with one test at a time); an idle worker steals queued tests, since the slow ones are unevenly spread.
# Tests must not assume they are alone on the machine (a lab test checks that its own namespaces are gone,
# not all of them); those marked `alone` run by themselves (tests/conftest.py).
exec .venv/bin/python -m pytest --numprocesses 2 --dist worksteal "$@"
