"""The faults `swarm chaos` injects into a local swarm, each on real processes:

- kill: SIGKILL a peer (a preempted machine); a new peer replaces it a moment later if the swarm
  is below its starting size (after a join it may not be);
- stop: SIGSTOP a peer, SIGCONT after a random pause (it must catch up with its mates);
- term: SIGTERM a peer (a graceful drain); replaced as after a kill;
- join: a fresh peer joins (its stage chosen by the peers' own rule);
- trainer: SIGKILL a trainer and start it again (same index: it completes what it had started);
- coordinator: SIGKILL the coordinator (the DHT carries on: new processes join through live
  peers) and start it again later;
- cut: cut a peer's network link for a while (its host in the swarm's network lab, --netns): frames to
  and from it vanish, no reset, no error; the peer runs on, is taken for dead, and must catch up once
  the link is mended.
A peer fault never takes the last serving peer of a stage (a stage with no peer and no checkpoint
has no state left: a different experiment)."""

from __future__ import annotations

import logging
import random
import signal
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.chaos.config import ChaosOptions
from swarm.chaos.observer import LocalObserver
from swarm.core.procs import ManagedProcess
from swarm.core.states import PeerState
from swarm.local import LocalSwarm

logger = logging.getLogger(__name__)


@dataclass
class FaultContext:
    swarm: LocalSwarm
    opts: ChaosOptions
    rng: random.Random
    initial_peers: int
    counts: Counter = field(default_factory=Counter)
    observer: object = field(default_factory=LocalObserver)  # LocalObserver or LabObserver
    stopped: set[int] = field(default_factory=set)  # pids of SIGSTOPped or cut-off peers
    timers: list[threading.Timer] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def later(self, delay_s: float, fn: Callable[[], None]) -> None:
        timer = threading.Timer(delay_s, self._guarded, args=(fn,))
        timer.daemon = True
        self.timers.append(timer)
        timer.start()

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            with self.lock:
                fn()
        except Exception:  # noqa: BLE001 - a failed follow-up must not stop the run
            logger.exception("chaos follow-up failed")

    def cancel_timers(self) -> None:
        for timer in self.timers:
            timer.cancel()


def serving_peers(ctx: FaultContext) -> dict[int, list[ManagedProcess]]:
    """Live, online, not stopped peers by the stage they serve now (peers move)."""
    procs = [p for p in ctx.swarm.peers if p.alive() and p.ready and p.pid not in ctx.stopped]
    answers = ctx.observer.probe([p.ready["address"] for p in procs])
    by_stage: dict[int, list[ManagedProcess]] = {}
    for proc in procs:
        answer = answers.get(proc.ready["address"])
        if answer is not None and answer[1] == PeerState.ONLINE:
            by_stage.setdefault(answer[0], []).append(proc)
    return by_stage


def pick_victim(ctx: FaultContext) -> ManagedProcess | None:
    candidates = [p for peers in serving_peers(ctx).values() if len(peers) >= 2 for p in peers]
    return ctx.rng.choice(candidates) if candidates else None


def _replace(ctx: FaultContext, victim: ManagedProcess) -> None:
    """A new peer takes the victim's place a moment later, if the swarm is below its starting size:
    churn keeps a swarm's size (a fleet's autoscaler replaces a preempted machine; volunteers come
    and go around a mean), and on one small machine every extra peer costs throughput by itself
    (docs/ARCHITECTURE.md, Chaos), which would be charged to the faults."""

    def maybe_replace() -> None:
        alive = sum(1 for p in ctx.swarm.peers if p.alive() and p is not victim)
        if alive < ctx.initial_peers:
            proc = ctx.swarm.start_peer("auto", wait=False)
            logger.info("%s replaces %s", proc.name, victim.name)
        else:
            logger.info("%s not replaced: %d peers serve (started with %d)", victim.name, alive, ctx.initial_peers)

    ctx.later(ctx.opts.replace_after_s, maybe_replace)


def kill(ctx: FaultContext) -> str | None:
    victim = pick_victim(ctx)
    if victim is None:
        return None
    victim.send_signal(signal.SIGKILL)
    _replace(ctx, victim)
    return f"SIGKILL {victim.name}"


def _hold(ctx: FaultContext, victim: ManagedProcess, longest_s: float, release: Callable[[], None]) -> float:
    """Keep a held victim (stopped, cut off) out of the victim choice until `release` runs, after a
    random pause of 2 s to `longest_s`; returns the pause."""
    ctx.stopped.add(victim.pid)
    pause = ctx.rng.uniform(2.0, longest_s)

    def end() -> None:
        release()
        ctx.stopped.discard(victim.pid)

    ctx.later(pause, end)
    return pause


def stop(ctx: FaultContext) -> str | None:
    victim = pick_victim(ctx)
    if victim is None:
        return None
    victim.send_signal(signal.SIGSTOP)
    pause = _hold(ctx, victim, ctx.opts.stop_pause_s, lambda: victim.send_signal(signal.SIGCONT))
    return f"SIGSTOP {victim.name} for {pause:.1f} s"


def term(ctx: FaultContext) -> str | None:
    victim = pick_victim(ctx)
    if victim is None:
        return None
    victim.send_signal(signal.SIGTERM)
    _replace(ctx, victim)
    return f"SIGTERM {victim.name}"


def join(ctx: FaultContext) -> str | None:
    alive = sum(1 for p in ctx.swarm.peers if p.alive())
    if alive >= ctx.initial_peers + ctx.opts.max_extra_peers:
        return None
    proc = ctx.swarm.start_peer("auto", wait=False)
    return f"join {proc.name}"


def trainer(ctx: FaultContext) -> str | None:
    index = ctx.rng.randrange(len(ctx.swarm.trainers))
    proc = ctx.swarm.trainers[index]
    if not proc.alive():
        return None
    proc.send_signal(signal.SIGKILL, group=True)
    ctx.later(ctx.opts.restart_after_s, lambda: ctx.swarm.restart_trainer(index))
    return f"SIGKILL trainer {index}, restarted after {ctx.opts.restart_after_s:.0f} s"


def coordinator(ctx: FaultContext) -> str | None:
    proc = ctx.swarm.coordinator
    if proc is None or not proc.alive():
        return None
    proc.send_signal(signal.SIGKILL, group=True)
    delay = 5 * ctx.opts.restart_after_s
    ctx.later(delay, lambda: ctx.swarm.start_coordinator(join=ctx.swarm.join_addresses()))
    return f"SIGKILL coordinator, restarted after {delay:.0f} s"


def cut(ctx: FaultContext) -> str | None:
    lab = ctx.swarm.lab
    victim = pick_victim(ctx) if lab is not None else None
    if victim is None:
        return None
    lab.cut(victim.name)
    pause = _hold(ctx, victim, ctx.opts.cut_pause_s, lambda: lab.cut(victim.name, False))
    return f"link of {victim.name} cut for {pause:.1f} s"


FAULTS: dict[str, Callable[[FaultContext], str | None]] = {
    "kill": kill,
    "stop": stop,
    "term": term,
    "join": join,
    "trainer": trainer,
    "coordinator": coordinator,
    "cut": cut,
}
