"""Running `ip`/`tc` commands, the availability check, and process identity (pid + start time) for labs.

Every external command goes through `run`, with a timeout and an error that names the command and quotes its
stderr.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 15.0
NEEDS_ROOT = "swarm local --netns needs root (network namespaces and tc): run it as root, or without --netns"


class NetLabError(RuntimeError):
    """A network lab cannot be set up or used; the message says why, in one line."""


def run(argv: Sequence[str], timeout: float = DEFAULT_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run a command, capture its output; raise NetLabError (command + stderr) when it fails or times out."""
    argv = list(argv)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise NetLabError(f"`{' '.join(argv)}` timed out after {timeout:.0f}s") from e
    except OSError as e:
        raise NetLabError(f"`{' '.join(argv)}` could not run: {e}") from e
    if check and proc.returncode != 0:
        err = (proc.stderr or proc.stdout).strip().replace("\n", " | ")
        raise NetLabError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {err}")
    return proc


def check_available() -> None:
    """Raise NetLabError with the fix when network labs cannot be used here (not root, no `ip netns`, no tc)."""
    if os.geteuid() != 0:
        raise NetLabError(NEEDS_ROOT)
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            raise NetLabError(f"`{tool}` not found: install {package} (e.g. apt-get install {package})")
    proc = run(["ip", "netns", "list"], check=False)
    if proc.returncode != 0:
        raise NetLabError(f"`ip netns` is unavailable ({proc.stderr.strip()}): the kernel needs CONFIG_NET_NS")


def process_start_time(pid: int) -> int | None:
    """The start time of a process in clock ticks since boot (field 22 of /proc/PID/stat); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def process_alive(pid: int, start_time: int | None) -> bool:
    """Whether the process that had this pid and start time is still running (not a reused pid, not a zombie)."""
    if pid <= 0:
        return False
    now = process_start_time(pid)
    if now is None or (start_time is not None and now != start_time):
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False
