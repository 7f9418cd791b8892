"""The compute thread's queue: queued requests merge up to `max_samples` (a peer passes the run's
microbatch, so whole microbatches run one at a time, in order: swarm.peer.executor.thread)."""

import collections

import torch

from swarm.peer.executor.tasks import BACKWARD, CALL, FORWARD, Task, take_batch


def _task(kind: str, tag: int, name: str, n: int = 8) -> Task:
    task = Task(kind, inputs=torch.zeros(n, 4), tag=tag, request_id=name)
    if kind == CALL:
        task.inputs, task.fn = None, lambda: name
    return task


def _order(tasks: list[Task], max_samples: int = 8) -> list[list[str]]:
    queue = collections.deque(tasks)
    out = []
    while queue:
        out.append([t.request_id for t in take_batch(queue, max_samples, lambda t: False)])
    return out


def test_microbatches_run_one_at_a_time_in_order_and_smaller_requests_merge_up_to_one():
    tasks = [_task(FORWARD, 3, f"f{i}") for i in range(4)]
    assert _order(tasks) == [["f0"], ["f1"], ["f2"], ["f3"]]
    assert _order(tasks, max_samples=32) == [["f0", "f1", "f2", "f3"]]  # what a peer did before
    halves = [_task(BACKWARD, 3, f"b{i}", n=4) for i in range(4)]
    assert _order(halves) == [["b0", "b1"], ["b2", "b3"]]
    steps = [_task(FORWARD, 3, "f3", n=4), _task(FORWARD, 4, "f4", n=4), _task(CALL, 0, "call")]
    assert _order(steps) == [["f3"], ["f4"], ["call"]]  # different steps never share a batch


def test_nothing_queued_after_a_function_call_is_merged_ahead_of_it():
    tasks = [_task(BACKWARD, 3, "b0", n=4), _task(CALL, 0, "freeze"), _task(BACKWARD, 3, "b1", n=4)]
    assert _order(tasks) == [["b0"], ["freeze"], ["b1"]]
    tasks = [_task(BACKWARD, 3, "b0", n=2), _task(BACKWARD, 3, "b1", n=2), _task(CALL, 0, "apply")]
    tasks.append(_task(BACKWARD, 3, "b2", n=2))
    assert _order(tasks) == [["b0", "b1"], ["apply"], ["b2"]]
