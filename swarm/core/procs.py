"""Child processes that are always reaped: each in its own process group (so hivemind's p2pd daemons
go with it), told to die with its parent (PR_SET_PDEATHSIG), stdout parsed for the parseable lines
(ready, progress, summary), stderr kept in a log file."""

from __future__ import annotations

import ctypes
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

READY_PREFIX = "SWARM_READY "
PROGRESS_PREFIX = "SWARM_PROGRESS "
SUMMARY_PREFIX = "SWARM_SUMMARY "
WAIT_SLICE_S = 0.5  # ManagedProcess.wait checks for signals at least this often
COUNTERS_PREFIX = "SWARM_COUNTERS "  # a peer's counters, printed once at shutdown
PARSED_LINES = (
    (READY_PREFIX, "ready"),
    (PROGRESS_PREFIX, "progress"),
    (SUMMARY_PREFIX, "summary"),
    (COUNTERS_PREFIX, "counters"),
)

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when the thread that created it exits (no-op where
    prctl is missing). hivemind's DHT and averager processes and their p2pd daemons use it so that a
    SIGKILLed peer leaves nothing serving on its behalf; `ManagedProcess` children get SIGTERM."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


def _die_gracefully_with_parent() -> None:
    die_with_parent(signal.SIGTERM)


class _Spawner:
    """Starts child processes from one long-lived thread. PR_SET_PDEATHSIG fires when the *thread*
    that forked the child exits: a child started from a short-lived thread (a timer restarting a
    trainer, say) would get its death signal at once. This thread lives as long as the process."""

    def __init__(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _run(self) -> None:
        while True:
            args, kwargs, done = self._requests.get()
            try:
                done.put((subprocess.Popen(*args, **kwargs), None))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                done.put((None, e))

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="process-spawner", daemon=True)
                self._thread.start()
        done: queue.Queue = queue.Queue(maxsize=1)
        self._requests.put((args, kwargs, done))
        proc, error = done.get()
        if error is not None:
            raise error
        return proc


_spawn = _Spawner().popen


class ProcessExited(RuntimeError):
    pass


class ManagedProcess:
    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        on_line: Callable[[ManagedProcess, str, dict | None], None] | None = None,
    ) -> None:
        self.name, self.argv, self.log_path = name, argv, Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in reap()
        self.on_line = on_line
        self.ready: dict | None = None
        self.summary: dict | None = None
        self.progress: dict | None = None
        self.counters: dict | None = None
        self.stdout_lines: list[str] = []
        self._ready_event = threading.Event()
        self._events: queue.Queue = queue.Queue()
        self.proc = _spawn(
            argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=_die_gracefully_with_parent,
            text=True,
            bufsize=1,
        )
        self.pgid = self.proc.pid  # a new session: its process group id is its pid
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.rstrip("\n")
            self.stdout_lines.append(line)
            payload = None
            for prefix, attr in PARSED_LINES:
                if line.startswith(prefix):
                    try:
                        payload = json.loads(line[len(prefix) :])
                    except ValueError:
                        payload = None
                    setattr(self, attr, payload)
                    if attr == "ready":
                        self._ready_event.set()
            if self.on_line is not None:
                try:
                    self.on_line(self, line, payload)
                except Exception:  # noqa: BLE001
                    logger.exception("line handler failed")
        self._ready_event.set()  # EOF: wake waiters

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float) -> dict:
        if not self._ready_event.wait(timeout):
            raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s; log {self.log_path}:\n{self.log_tail()}")
        if self.ready is None:
            self.proc.wait(timeout=5)
            raise ProcessExited(
                f"{self.name} exited with code {self.proc.returncode} before it was ready; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        return self.ready

    def send_signal(self, sig: int, group: bool = False) -> None:
        try:
            if group:
                os.killpg(self.pgid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code. Waits in slices of WAIT_SLICE_S: a main thread blocked in one long waitpid
        runs no Python signal handler until it returns, so a Ctrl-C that landed on another thread of
        `swarm local` went unheard while it waited for a trainer that trains for ever
        (tests/unit/test_procs_wait.py)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = WAIT_SLICE_S if deadline is None else min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic()))
            try:
                return self.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (graceful), then SIGKILL of the whole group; always reaps."""
        if self.alive():
            self.send_signal(signal.SIGCONT, group=True)  # a stopped process cannot handle SIGTERM
            self.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", self.name, timeout)
        self.kill_group()
        return self.proc.returncode

    def kill_group(self) -> None:
        """SIGKILL everything left in the process group (hivemind's p2pd included) and reap."""
        self.send_signal(signal.SIGKILL, group=True)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("%s (pid %d) survived SIGKILL", self.name, self.pid)
        self._reader.join(timeout=5)
        if not self._log.closed:
            self._log.close()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
