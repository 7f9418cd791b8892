"""Ctrl-C stops a process waiting for a child, whichever of its threads the signal lands on.

A main thread blocked in one long waitpid runs no Python signal handler until the wait returns: a
SIGINT handled by another thread (Linux may deliver a process's signal to any of its threads) would
leave `swarm local` waiting for a trainer that trains for ever. ManagedProcess.wait waits in slices,
so the handler runs within one. (Found while chasing test_dashboard_live's hang, whose cause was
another: an inherited SIG_IGN, see tests/integration/test_averager_restart.py.)"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

SCRIPT = textwrap.dedent(
    """
    import signal, sys, threading, time
    from swarm.core.procs import ManagedProcess

    child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], sys.argv[1])

    def interrupt_from_this_thread():
        time.sleep(0.5)  # the main thread is in child.wait() by then (earlier, the test could not fail)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # the C handler runs on this thread

    threading.Thread(target=interrupt_from_this_thread, daemon=True).start()
    began = time.monotonic()
    try:
        child.wait()
        print("wait returned", flush=True)
    except KeyboardInterrupt:
        print(f"interrupted after {time.monotonic() - began:.2f} s", flush=True)
    finally:
        child.proc.kill()
        child.proc.wait()
    """
)


@pytest.mark.timeout(60)
def test_a_sigint_on_another_thread_interrupts_the_wait(tmp_path):
    began = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "sleeper.log")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the script and its sleeping child
        out, err = proc.communicate()
    assert "interrupted after" in out, (out, err[-2000:])
    assert time.monotonic() - began < 20  # not the child's 60 s
