"""The peer daemon on a real box: `swarm peer --check` (exit 0 when all is well, 2 with one line per problem),
a persistent identity (a restarted peer keeps its peer id), and a peer behind NAT told at start that others
cannot reach it (the coordinator dials its announced addresses back; the lab's NAT host drops incoming
connections)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from swarm.core.procs import ManagedProcess
from swarm.netlab import NetLab, check_available
from tests.integration.helpers import assert_all_reaped, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PY = sys.executable


def test_restarted_peer_keeps_its_identity(make_swarm, tmp_path):
    swarm = make_swarm(stages=1, peers_per_stage=1)
    swarm.start_coordinator()
    identity = str(tmp_path / "keys" / "peer.id")
    first = swarm.start_peer(0, ["--identity-path", identity, "--no-rebalance"])
    first.stop()
    again = swarm.start_peer(0, ["--identity-path", identity, "--no-rebalance"])
    assert again.ready["peer_id"] == first.ready["peer_id"]
    other = swarm.start_peer(0, ["--no-rebalance"])
    assert other.ready["peer_id"] != first.ready["peer_id"]


def check(host, maddr: str) -> subprocess.CompletedProcess:
    argv = [PY, "-m", "swarm.cli", "peer", "--run-id", "natrun", "--initial-peers", maddr, "--check",
            "--host", host.ip, "--stage", "0"]  # fmt: skip
    return subprocess.run(host.wrap(argv), capture_output=True, text=True, timeout=120, start_new_session=True)


def test_check_and_a_peer_behind_nat(tmp_path):
    check_available()
    with NetLab("pytest-peer-nat", profile="lan") as lab:
        hosts = {n: lab.add_host(n, inbound=n != "natted") for n in ("coordinator", "open", "natted")}
        c = hosts["coordinator"]
        argv = [PY, "-m", "swarm.cli", "coordinator", "--run-id", "natrun", "--stages", "2", "--host", c.ip]
        coordinator = ManagedProcess("coordinator", c.wrap(argv), tmp_path / "coordinator.log")
        procs = [coordinator]
        try:
            maddr = coordinator.wait_ready(60)["initial_peers"][0]
            ok = check(hosts["open"], maddr)
            assert ok.returncode == 0, ok.stderr
            assert "ok       reachability" in ok.stdout and "all checks passed" in ok.stdout
            bad = check(hosts["natted"], maddr)
            assert bad.returncode == 2, bad.stdout + bad.stderr
            problems = [line for line in bad.stderr.splitlines() if line.startswith("problem")]
            assert len(problems) == 1 and "reachability" in problems[0], bad.stderr
            assert "is not reachable from" in problems[0] and "--announce-host" in problems[0]
            assert "no answer within" in problems[0]  # the SYN was dropped: a NAT, not a closed port
            n = hosts["natted"]
            argv = [PY, "-m", "swarm.cli", "peer", "--run-id", "natrun", "--initial-peers", maddr, "--host", n.ip]
            peer = ManagedProcess("natted-peer", n.wrap(argv), tmp_path / "natted-peer.log")
            procs.append(peer)
            peer.wait_ready(120)
            wait_for(lambda: "is not reachable from" in peer.log_path.read_text(), 60, "the NAT warning")
            warning = next(li for li in peer.log_path.read_text().splitlines() if "is not reachable from" in li)
            assert " W [peer " in warning and "peers/README.md" in warning
        finally:
            for proc in procs:
                proc.stop()
            assert_all_reaped([p.pgid for p in procs])
