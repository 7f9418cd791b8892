"""The compute thread of a peer: a bounded queue of tasks, one thread that takes them in batches, and
the inline path.

A task is handed from the event loop to the compute thread and its result handed back: two thread
wake-ups and about 0.25 ms of CPU per request on this project's 2-core test machine, more than a
cheap stage's whole forward. So a forward whose measured cost is below `INLINE_MAX_S` runs on the
caller's thread instead, when nothing is queued and the compute thread is idle; the two never
compute at once (`_busy`), so the single-owner rule of the module, accumulators and optimizer holds.

Queued tasks of one kind and shape are merged into one batch up to `max_batch_samples`. A peer sets
that to the run's microbatch, so whole microbatches are computed one at a time: merged, the first
one's answer waited for the others' compute and the next stage sat idle meanwhile (1 peer per stage:
exact 112.6 / 130.4 samples/s against 155.7 / 140.6 one at a time, async 97.4 / 107.3 against
148.8 / 160.2; docs/BENCHMARKS.md). A larger microbatch is the knob for a device that wants
larger batches: it keeps the pipeline's overlap.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any

from swarm.core.errors import ExecutorStopped, Overloaded, RequestInvalid, SwarmError
from swarm.peer.executor.tasks import BACKWARD, CALL, EVAL, FORWARD, Task, take_batch

logger = logging.getLogger(__name__)

# a forward expected to take less than this runs on the caller's thread (see the module docstring)
INLINE_MAX_S = 0.0005

# what torch raises on a request the schema let through but the module cannot take
REQUEST_FAULTS = (ValueError, RuntimeError, IndexError, TypeError)


class ComputeThread:
    """The queue and the thread; a subclass computes (`_run_forward`, `_run_backward`, `_is_duplicate`)."""

    stage_label: str
    max_batch_samples: int
    forward_s_per_sample: float | None  # measured by the subclass; None until the first forward

    def _start_thread(self, name: str, max_queue_tasks: int, max_queue_bytes: int) -> None:
        self._queue: collections.deque[Task] = collections.deque()
        self._queued_bytes = 0
        self.max_queue_tasks, self.max_queue_bytes = max_queue_tasks, max_queue_bytes
        self._cv = threading.Condition()
        self._stopped = False
        self._busy = False  # a batch is being computed, on the compute thread or inline
        self.inline_tasks = 0  # forwards run on the caller's thread so far
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def queue_length(self) -> int:
        return len(self._queue)

    # ---- submission (any thread) ----

    def submit(self, task: Task) -> concurrent.futures.Future:
        nbytes = task.nbytes
        with self._cv:
            if self._stopped:
                raise ExecutorStopped(f"{self.stage_label}'s executor is stopped (leaving or shutting down)")
            if task.kind != CALL and (
                len(self._queue) >= self.max_queue_tasks or self._queued_bytes + nbytes > self.max_queue_bytes
            ):
                raise Overloaded(
                    f"{self.stage_label}'s compute queue is full ({len(self._queue)} requests, "
                    f"{self._queued_bytes >> 20} MiB); retry later"
                )
            self._queue.append(task)
            self._queued_bytes += nbytes
            self._cv.notify()
        return task.future

    def submit_or_run(self, task: Task, inline: bool) -> concurrent.futures.Future:
        """`submit`, or with `inline`, run a cheap forward on this thread when the compute thread is
        idle (the returned future is then done)."""
        if inline and self._runs_inline(task):
            return task.future
        return self.submit(task)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the compute thread, between batches: safe access to parameters and state."""
        return self.submit(Task(CALL, fn=fn))

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            pending = list(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cv.notify_all()
        for task in pending:
            if not task.future.done():
                task.future.set_exception(ExecutorStopped(f"{self.stage_label}'s executor stopped"))
        self._thread.join(timeout=10)

    def _runs_inline(self, task: Task) -> bool:
        per_sample = self.forward_s_per_sample
        if task.kind not in (FORWARD, EVAL) or per_sample is None or per_sample * task.size > INLINE_MAX_S:
            return False
        with self._cv:
            if self._stopped or self._busy or self._queue:
                return False
            self._busy = True
        try:
            if task.future.set_running_or_notify_cancel():
                self.inline_tasks += 1
                self._execute([task])
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify()
        return True

    # ---- compute thread ----

    def _next_batch(self) -> list[Task] | None:
        with self._cv:
            while (not self._queue or self._busy) and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            batch = take_batch(self._queue, self.max_batch_samples, self._is_duplicate)
            self._queued_bytes -= sum(t.nbytes for t in batch)
            self._busy = True
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                live = [t for t in batch if t.future.set_running_or_notify_cancel()]
                if live:
                    self._execute(live)
            finally:
                with self._cv:
                    self._busy = False

    def _execute(self, live: list[Task]) -> None:
        """Run one batch; every error goes back to its requesters."""
        kind = live[0].kind
        try:
            if kind == CALL:
                live[0].future.set_result(live[0].fn())
            elif kind == BACKWARD:
                self._run_backward(live)
            else:
                self._run_forward(live, train=kind == FORWARD)
        except BaseException as e:  # noqa: BLE001 - every error goes back to its requester
            if kind != CALL and isinstance(e, REQUEST_FAULTS) and not isinstance(e, SwarmError):
                e = RequestInvalid(f"{type(e).__name__}: {e}")
            elif not isinstance(e, (SwarmError, *REQUEST_FAULTS)):
                logger.exception("unexpected error in the compute thread")
            for task in live:
                if not task.future.done():
                    task.future.set_exception(e)

    # ---- the subclass computes ----

    def _is_duplicate(self, task: Task) -> bool:
        raise NotImplementedError

    def _run_forward(self, tasks: list[Task], train: bool) -> None:
        raise NotImplementedError

    def _run_backward(self, tasks: list[Task]) -> None:
        raise NotImplementedError
