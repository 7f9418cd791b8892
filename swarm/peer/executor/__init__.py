"""A peer's compute: the thread that owns the stage's module (`compute`), what it works on
(`tasks`), the gradient sums per update (`accumulators`) and the async look-ahead (`lookahead`)."""

from swarm.peer.executor.accumulators import Accumulated
from swarm.peer.executor.compute import StageExecutor
from swarm.peer.executor.tasks import BackwardResult, ForwardResult

__all__ = ["Accumulated", "BackwardResult", "ForwardResult", "StageExecutor"]
