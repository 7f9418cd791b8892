"""Errors a user can act on: each mistake ends in one line on stderr that names the problem and the fix, exit
code 2, no traceback, and nothing left running (every command runs in its own process group, checked empty
afterwards). `swarm local` finds its mistakes before it starts any process (no process log is written)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from swarm.core.procs import ManagedProcess
from tests.integration.helpers import assert_all_reaped

pytestmark = pytest.mark.timeout(120)

GONE = "/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def swarm_cmd(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    """Run `swarm ARGS` in its own process group; return (exit code, stderr, seconds) once its group is empty."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarm.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert_all_reaped([proc.pid], timeout=10)  # nothing of it is left running: no DHT process, no p2pd
    return proc.returncode, err, time.monotonic() - t0


def assert_one_line_error(rc: int, err: str, *words: str) -> str:
    assert rc == 2, f"exit code {rc}, stderr:\n{err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    line = lines[0]
    assert line.startswith("swarm ") and ": error: " in line, line
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"
    return line


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    """A live coordinator of run 'errors-run' (3 stages) to join with wrong settings."""
    log = tmp_path_factory.mktemp("errors") / "coordinator.log"
    argv = [sys.executable, "-m", "swarm.cli", "coordinator", "--run-id", "errors-run", "--stages", "3"]
    proc = ManagedProcess("coordinator", argv, log)
    try:
        yield proc.wait_ready(60)["initial_peers"][0]
    finally:
        proc.stop()
        assert_all_reaped([proc.pgid])


def test_unreachable_coordinator_peer_and_trainer():
    gone = GONE.format(port=free_port())
    for role in ("peer", "trainer"):
        rc, err, seconds = swarm_cmd(role, "--run-id", "r", "--initial-peers", gone)
        assert_one_line_error(rc, err, "cannot connect to --initial-peers", "is the coordinator")
        assert seconds < 30


def test_bad_multiaddr():
    rc, err, _ = swarm_cmd("peer", "--run-id", "r", "--initial-peers", "127.0.0.1:7001")
    assert_one_line_error(rc, err, "is not a multiaddr", "/p2p/")
    rc, err, _ = swarm_cmd("trainer", "--run-id", "r", "--initial-peers", "/ip4/127.0.0.1/tcp/7001")
    assert_one_line_error(rc, err, "peer id")


def test_wrong_peer_id_at_a_live_port(coordinator):
    port = coordinator.split("/tcp/")[1].split("/")[0]
    rc, err, _ = swarm_cmd("peer", "--run-id", "errors-run", "--initial-peers", GONE.format(port=port))
    assert_one_line_error(rc, err, "could not join", "peer id included")


def test_wrong_run_id_is_told_fast(coordinator):
    for role in ("peer", "trainer"):
        rc, err, seconds = swarm_cmd(role, "--run-id", "erors-run", "--initial-peers", coordinator)
        assert_one_line_error(rc, err, "'erors-run' is not on this DHT", "errors-run", "--run-id")
        assert seconds < 30, seconds  # not the 60 s join timeout


def test_out_of_range_stage(coordinator):
    rc, err, _ = swarm_cmd("peer", "--run-id", "errors-run", "--initial-peers", coordinator, "--stage", "7")
    assert_one_line_error(rc, err, "--stage 7 is out of range", "0..2", "--stage auto")


def test_port_in_use_and_unwritable_checkpoint_dir(coordinator, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = str(s.getsockname()[1])
        for flag in ("--port", "--dht-port"):
            rc, err, _ = swarm_cmd("peer", "--run-id", "errors-run", "--initial-peers", coordinator, flag, port)
            assert_one_line_error(rc, err, f"{flag} {port} is already in use")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ("peer", "--run-id", "errors-run", "--initial-peers", coordinator, "--checkpoint-dir", f"{blocker}/ckpt")
    assert_one_line_error(*swarm_cmd(*args)[:2], "--checkpoint-dir", "not a writable folder")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda():
    gone = GONE.format(port=free_port())
    rc, err, _ = swarm_cmd("peer", "--run-id", "r", "--initial-peers", gone, "--device", "cuda")
    assert_one_line_error(rc, err, "CUDA is not available", "--device cpu")


LOCAL_MISTAKES = {
    "missing-data-path": (["--dataset", "text", "--data-path", "/nonexistent/texts"], ["--data-path", "not a folder"]),
    "no-data-path": (["--dataset", "tokens"], ["--dataset tokens needs --data-path"]),
    "model-list": (["--model", "[1]"], ["--model must be one of", "JSON object"]),
    "missing-config": (["--config", "/nonexistent/run.json"], ["cannot read --config", "No such file"]),
    "layout": (["--stages", "3", "--stage-layout", "1,1"], ["--stage-layout 1,1 has 2 entries"]),
    "checkpoint-dir": (["--checkpoint-dir", "/proc/version/ckpt"], ["--checkpoint-dir", "not a writable folder"]),
    "custom-model": (["--custom-model", "no_such_module:build"], ["cannot import model factory"]),
}


@pytest.mark.parametrize("case", sorted(LOCAL_MISTAKES))
def test_local_checks_before_starting_anything(case, tmp_path):
    args, words = LOCAL_MISTAKES[case]
    logs = tmp_path / "logs"
    rc, err, seconds = swarm_cmd("local", "--log-dir", str(logs), *args)
    assert_one_line_error(rc, err, *words)
    assert not list(Path(logs).glob("*.log")), "a process was started"
    assert seconds < 30


def test_a_custom_model_from_the_dht_is_not_imported_without_allow_model(tmp_path):
    """The run config names a custom factory: a peer (or trainer) whose operator did not allow it refuses
    to import it (the DHT never makes a process run code) and says which flag allows it."""
    examples = str(Path(__file__).resolve().parents[2] / "examples")
    argv = [
        sys.executable, "-m", "swarm.cli", "coordinator", "--run-id", "custom-run", "--stages", "2",
        "--custom-model", "tiny_mlp:build_stages", "--custom-model-path", examples,
    ]  # fmt: skip
    proc = ManagedProcess("coordinator", argv, tmp_path / "coordinator.log")
    try:
        address = proc.wait_ready(60)["initial_peers"][0]
        for role in ("peer", "trainer"):
            rc, err, _ = swarm_cmd(
                role, "--run-id", "custom-run", "--initial-peers", address, "--custom-model-path", examples
            )
            assert_one_line_error(rc, err, "tiny_mlp:build_stages", "--allow-model tiny_mlp:build_stages")
    finally:
        proc.stop()
        assert_all_reaped([proc.pgid])
