"""`swarm chaos --schedule`: every scheduled fault happens, even one that finds no victim at its time
(swarm.chaos.runner._inject retries it until the next one is due)."""

import random
import time

import swarm.chaos.runner as runner
from swarm.chaos.config import ChaosOptions
from swarm.chaos.faults import FaultContext


def test_a_scheduled_fault_without_a_victim_is_retried_until_the_next_is_due(monkeypatch):
    tries: list[str] = []

    def kill(ctx):  # no victim for the first two tries (e.g. a replacement still joining)
        tries.append("kill")
        return "SIGKILL peer1" if tries.count("kill") > 2 else None

    def never(ctx):  # never a victim: given up when the next fault is due, not retried forever
        tries.append("stop")
        return None

    monkeypatch.setattr(runner, "FAULTS", {"kill": kill, "stop": never, "term": lambda ctx: "SIGTERM peer2"})
    monkeypatch.setattr(runner, "RETRY_S", 0.05)
    ctx = FaultContext(swarm=None, opts=ChaosOptions(), rng=random.Random(0), initial_peers=6, observer=None)
    start = time.monotonic()
    runner._inject(ctx, [(0.0, "kill"), (0.3, "stop"), (0.6, "term")], start, deadline=start + 5)
    assert ctx.counts == {"kill": 1, "term": 1}
    assert tries.count("kill") == 3
    assert 3 <= tries.count("stop") <= 7  # retried every 0.05 s for 0.3 s, then left for "term"
    assert time.monotonic() - start < 2
