#!/usr/bin/env bash
# The main job: a local swarm (coordinator, 3 stages x 2 peers, 1 trainer, all separate processes on
# loopback) training a GPT on the bytes of the Python standard library. Extra arguments go to
# `swarm local` (see `swarm local --help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/swarm local "$@"
