"""Lab state records and removal: what a lab leaves on the machine, and how it is taken away.

A lab owns: namespaces swnl-KEY-* (removing them destroys its interfaces, which live only inside them), the
processes still running in those namespaces, /etc/netns/swnl-KEY-*/ (per-namespace /etc/hosts), and its state
record /run/swarm-netlab/KEY.json with the owner's pid and start time. A lab is stale when its owner is gone
(pid dead or reused); cleanup_stale() removes stale labs, or every lab whose namespaces match a prefix.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from typing import Any

from swarm.netlab.naming import ETC_NETNS, NS_PREFIX, STATE_DIR, parse_netns
from swarm.netlab.system import NetLabError, process_alive, process_start_time, run

log = logging.getLogger(__name__)


def state_path(key: str) -> str:
    return os.path.join(STATE_DIR, f"{key}.json")


def forwarder_log_path(key: str) -> str:
    return os.path.join(STATE_DIR, f"{key}.forwarder.log")


def write_state(key: str, run_id: str, **extra: Any) -> None:
    """Record this process as the owner of lab `key` (written before anything of the lab is created)."""
    os.makedirs(STATE_DIR, exist_ok=True)
    pid = os.getpid()
    state = {"key": key, "run_id": run_id, "owner_pid": pid, "owner_start": process_start_time(pid), **extra}
    tmp = state_path(key) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, state_path(key))


def read_state(key: str) -> dict[str, Any] | None:
    try:
        with open(state_path(key)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def owner_alive(state: dict[str, Any] | None) -> bool:
    return bool(state) and process_alive(int(state.get("owner_pid", 0)), state.get("owner_start"))


def list_netns() -> list[str]:
    """Names of all namespaces of `ip netns list` (its lines read "NAME" or "NAME (id: N)")."""
    out = run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_netns(key: str) -> list[str]:
    return [ns for ns in list_netns() if parse_netns(ns) == key]


def netns_pids(netns: str) -> list[int]:
    proc = run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split() if p.isdigit()]


def kill_netns_processes(namespaces: list[str], grace_s: float) -> None:
    """SIGTERM every process left in these namespaces, then SIGKILL those alive after grace_s."""
    sig = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
    pids = [pid for ns in namespaces for pid in netns_pids(ns) if pid != os.getpid()]
    for pid in pids:
        log.info("killing pid %d left in the lab's namespaces (signal %s)", pid, sig.name)
        _signal(pid, sig)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [pid for pid in pids if process_alive(pid, None)]
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    except OSError as e:
        log.warning("cannot signal pid %d: %s", pid, e)


def remove_lab(key: str, grace_s: float = 0.0, namespaces: list[str] | None = None) -> list[str]:
    """Remove everything lab `key` left (processes, namespaces, /etc/netns files, state); return the namespaces
    removed. Never raises: failures are logged."""
    removed: list[str] = []
    try:
        found = lab_netns(key) if namespaces is None else namespaces
        kill_netns_processes(found, grace_s)
        for ns in found:
            proc = run(["ip", "netns", "del", ns], check=False)
            if proc.returncode == 0:
                removed.append(ns)
            else:
                log.warning("`ip netns del %s` failed: %s", ns, proc.stderr.strip())
    except NetLabError as e:
        log.warning("removing lab %s: %s", key, e)
    _remove_files(key)
    return removed


def _remove_files(key: str) -> None:
    try:
        etc = [d for d in os.listdir(ETC_NETNS) if parse_netns(d) == key]
    except OSError:
        etc = []
    for d in etc:
        shutil.rmtree(os.path.join(ETC_NETNS, d), ignore_errors=True)
    for path in (state_path(key), forwarder_log_path(key)):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("cannot remove %s: %s", path, e)


def _known_keys() -> dict[str, list[str]]:
    """Lab key -> its namespaces, for every lab with namespaces, /etc/netns entries or a state record."""
    keys: dict[str, list[str]] = {}
    for ns in list_netns():
        key = parse_netns(ns)
        if key:
            keys.setdefault(key, []).append(ns)
    for d in os.listdir(ETC_NETNS) if os.path.isdir(ETC_NETNS) else []:
        key = parse_netns(d)
        if key:
            keys.setdefault(key, [])
    for name in os.listdir(STATE_DIR) if os.path.isdir(STATE_DIR) else []:
        if name.endswith(".json") and len(name) == len("abcdef.json"):
            keys.setdefault(name[:6], [])
    return keys


def _matches(prefix: str, key: str, namespaces: list[str]) -> bool:
    lab = f"{NS_PREFIX}{key}-"
    return lab.startswith(prefix) or prefix.startswith(lab) or any(ns.startswith(prefix) for ns in namespaces)


def cleanup_stale(prefix: str | None = None) -> list[str]:
    """Remove labs whose owner process is gone; with `prefix`, every lab with a namespace name starting with it
    (alive or not, e.g. "swnl-" for all labs). Returns the namespaces removed."""
    if prefix is not None and not prefix.startswith(NS_PREFIX) and not NS_PREFIX.startswith(prefix):
        log.info("cleanup_stale: prefix %r matches no lab namespace (they start with %r)", prefix, NS_PREFIX)
        return []
    removed: list[str] = []
    for key, namespaces in _known_keys().items():
        if prefix is not None:
            if not _matches(prefix, key, namespaces):
                continue
        elif owner_alive(read_state(key)):
            continue
        log.info("removing lab %s (namespaces: %s)", key, ", ".join(namespaces) or "none")
        removed += remove_lab(key, namespaces=namespaces)
    return removed
