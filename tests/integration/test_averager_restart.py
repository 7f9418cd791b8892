"""A stage's hivemind averager process that dies is replaced, and the replacement averages.

Two peers' DHT nodes (each a DHT process and a p2p daemon) and their averager processes, real: one
averager is SIGKILLed. Its stream handlers stay registered in the p2p daemon it shares with its DHT
node; before they were removed, its replacement failed to start ("handler ... already set"), the
peer never averaged again, and its stage stalled (a 3x4 swarm whose stage 0 grew to 6 peers by
rebalancing waited at 16 of 32 samples for ever)."""

import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch

from swarm.dht.node import SwarmDHT
from swarm.training import averaging
from swarm.training.averaging import AveragingConfig, StageAverager


def average_together(averagers: list[StageAverager], grads: list[torch.Tensor], step: int) -> list:
    """One all-reduce round of all `averagers` at once (each blocks until the round ends)."""
    members = [a.peer_id for a in averagers]
    results: list = [None] * len(averagers)

    def run(i: int) -> None:
        try:
            results[i] = averagers[i].average([grads[i]], 1, step, [m for m in members if m != members[i]])
        except Exception as e:  # noqa: BLE001 - returned to the assertion
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(averagers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.mark.timeout(180)
def test_a_killed_averager_is_replaced_and_the_replacement_averages():
    cfg = AveragingConfig(allreduce_timeout_s=20.0)
    first = SwarmDHT("restart")
    second = SwarmDHT("restart", first.visible_maddrs())
    averagers = []
    try:
        params = [torch.zeros(64)]
        sigint = signal.getsignal(signal.SIGINT)
        averagers = [StageAverager(d.dht, "restart", 0, params, cfg) for d in (first, second)]
        # hivemind set SIGINT to SIG_IGN in this process; a peer (and everything started after) ignored Ctrl-C
        assert signal.getsignal(signal.SIGINT) is sigint
        grads = [torch.full((64,), 1.0), torch.full((64,), 3.0)]
        before = average_together(averagers, grads, step=1)
        assert all(not isinstance(r, Exception) for r in before), before
        assert torch.allclose(before[0].mean[0], torch.full((64,), 2.0))

        os.kill(averagers[0].averager.pid, signal.SIGKILL)
        averagers[0].averager.join(timeout=10)  # the averager is a child process of this one
        assert not averagers[0].alive
        averagers[0].shutdown()  # what the peer does before starting a replacement
        averagers[0] = StageAverager(first.dht, "restart", 0, params, cfg)
        assert averagers[0].alive

        after = average_together(averagers, [torch.full((64,), 5.0), torch.full((64,), 7.0)], step=2)
        assert all(not isinstance(r, Exception) for r in after), after
        for result in after:
            assert torch.allclose(result.mean[0], torch.full((64,), 6.0))
    finally:
        for a in averagers:
            a.shutdown()
        second.shutdown()
        first.shutdown()


@pytest.mark.timeout(120)
def test_an_averager_that_dies_before_it_is_ready_fails_its_start_within_the_deadline(monkeypatch):
    """A joining peer's averager process once died at once (a gRPC fatal error in the forked child),
    and the peer waited for it to be ready for ever, its event loop blocked. The start now has a
    deadline: it fails as a failed round does (the stage tries again), and nothing is left running."""
    monkeypatch.setattr(averaging, "START_TIMEOUT_S", 5.0)
    monkeypatch.setattr(averaging._StageAverager, "run", lambda self: os._exit(3))  # dies in the child at once
    node = SwarmDHT("dies")
    try:
        started = time.monotonic()
        with pytest.raises(averaging.AveragingFailed, match="could not start an averager process"):
            StageAverager(node.dht, "dies", 0, [torch.zeros(8)], AveragingConfig())
        assert time.monotonic() - started < 30
        assert not [p for p in multiprocessing.active_children() if isinstance(p, averaging._StageAverager)]
    finally:
        node.shutdown()
