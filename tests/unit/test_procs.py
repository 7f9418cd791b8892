"""Child processes: reaped with their process group, and alive however short-lived the thread
that started them (PR_SET_PDEATHSIG fires when the forking *thread* exits: chaos restarts trainers
and peers from timer threads)."""

import sys
import threading
import time

from swarm.core.procs import ManagedProcess, group_alive


def test_a_child_started_from_a_short_lived_thread_outlives_it(tmp_path):
    started: list[ManagedProcess] = []
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    thread = threading.Thread(target=lambda: started.append(ManagedProcess("sleeper", argv, tmp_path / "s.log")))
    thread.start()
    thread.join()
    proc = started[0]
    try:
        time.sleep(1.0)
        assert proc.alive(), f"the child died with the thread that started it (code {proc.proc.returncode})"
    finally:
        proc.stop(timeout=5)
    assert not proc.alive() and not group_alive(proc.pgid)
