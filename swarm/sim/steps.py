"""Optimizer steps in the simulator: the pacing of the trainers, the step barrier and the all-reduce.

As in swarm.peer.stepping: trainers tag every microbatch with a step and give each step exactly its
share of the global batch B (swarm.policy.pacing.StepPacer, the real one). A stage's peers count the
samples whose backward they computed; once the stage holds B for its next update t, its peers notice
(a stage of at most 17 peers at once, through its mates' watches; a larger one within one Info poll
of the mates: half a period on average), agree on the update's contents (one
RPC round among them), all-reduce the gradient and apply it. The global step, which the trainers pace
against, is the minimum over stages, and they see it within one Info poll. In exact mode a trainer
starts step t+1 only after every stage applied t; in async mode, up to `max_staleness` steps' worth
of samples ahead, once `ahead_after` of its step-t samples are done.

The all-reduce is hivemind's butterfly: each of the n members sends and receives about
2 x gradient bytes x (n - 1) / n over its link, so the slowest link (after polling traffic) sets the
time, plus a latency per phase (scatter-reduce, all-gather). A member that dies or leaves during a
round fails it; the others retry after `failure_timeout`. The gradients a dead or departed peer held
for updates not yet applied are replayed by the trainers on its stage-mates (a backward each), as
swarm.trainer.replay does, so that every update holds exactly its batch; runs count violations (0).

Coarse steps. The simulated microbatches bundle many real ones (a hop computes for seconds), so the
pipeline holds far more samples than a real one, and a step of B samples can be shorter than one trip
of a microbatch: pacing trainers by B would starve the pipeline for a reason a real swarm does not
have. So the trainers' StepPacer works on simulated steps of k x B samples, k = ceil(4 x samples in
flight / B) (1 when B is large enough: then all of this is literal). Within a simulated step, each
stage still applies the k optimizer steps one by one: round j starts once the stage holds j x B of
the step's samples and round j - 1 is done, and a death or departure fails only the round under way
and replays only what is not applied yet (the stage's unapplied samples, in proportion to what the
peer holds). And a trainer may complete at most (1 + max_staleness) optimizer steps beyond the
global optimizer step (what the real bound allows), its samples in flight aside: a stage whose rounds
cannot keep up holds the trainers back. What k > 1 loses: `ahead_after` works per simulated step, and
exact mode drains the pipeline once per k steps, so exact mode is only quoted where k = 1.
"""

from __future__ import annotations

import logging
import math
from collections import deque

from swarm.policy.pacing import StepPacer
from swarm.sim.entities import REPLAY, RETRY_UPDATE, SEEN, UPDATE, Microbatch, Peer

logger = logging.getLogger(__name__)

NO_TARGET = 1 << 62  # trainers in the simulation never stop
ALLREDUCE_PHASES = 2  # butterfly all-reduce: scatter-reduce, then all-gather
BATCH_PER_IN_FLIGHT = 4  # a simulated step holds at least this many times the samples in flight:
# with `ahead_after` 0.75 a trainer starts step t+1 once three quarters of its step t are done, so
# the pacing never holds back a healthy pipeline


def steps_per_sim_step(global_batch: float, in_flight_samples: float) -> int:
    """k: the optimizer steps one simulated step stands for (see the module's docstring)."""
    return max(1, math.ceil(BATCH_PER_IN_FLIGHT * in_flight_samples / global_batch - 1e-9))


def trainer_shares(global_batch: int, trainers: int) -> list[int]:
    """RunConfig.trainer_share for every trainer: the batch split as evenly as possible."""
    base, extra = divmod(global_batch, trainers)
    return [base + (1 if i < extra else 0) for i in range(trainers)]


def allreduce_seconds(members: list[Peer], grad_bytes: float, bandwidth) -> float:
    """Butterfly all-reduce among `members`: the slowest link moves 2 x (n-1)/n of the gradient, and
    each phase waits for the farthest pair (latency is one way per end, as for transfers)."""
    n = len(members)
    if n < 2:
        return 0.0
    slowest = min(bandwidth(p) for p in members)
    farthest = max(p.lat for p in members)
    return 2 * grad_bytes * (n - 1) / n / slowest + ALLREDUCE_PHASES * 2 * farthest


class Steps:
    """Mixed into swarm.sim.engine.Simulator."""

    def _init_steps(self) -> None:
        cfg, S, K = self.cfg, self.cfg.stages, self.cfg.trainers
        self.k = steps_per_sim_step(cfg.global_batch, cfg.in_flight * self.b)
        self.step_batch = float(int(cfg.global_batch))  # samples per optimizer step
        self.batch = self.k * self.step_batch  # samples per simulated step
        exact = cfg.sync == "exact"
        self.staleness, ahead = (0.0, 0.0) if exact else (cfg.max_staleness, cfg.ahead_after)
        self.pacers = [StepPacer(share, self.staleness, ahead) for share in trainer_shares(int(self.batch), K)]
        self.real_shares = trainer_shares(int(self.step_batch), K)
        self.slots = [len(range(i, cfg.in_flight, K)) for i in range(K)]
        self.started = [0.0] * K  # samples each trainer started (the real staleness bound, when k > 1)
        self.stage_step = [0] * S  # simulated steps applied by each stage
        self.applied = [0] * S  # optimizer steps applied within the stage's current simulated step
        self.counts: list[dict[int, float]] = [{} for _ in range(S)]  # samples held per simulated step
        self.rounds: list[tuple[int, set[Peer], float] | None] = [None] * S  # (token, members, began)
        self.tokens = 0
        self.global_step = self.seen_step = 0  # simulated steps every stage applied (and as trainers see it)
        self.real_step = self.seen_real = 0  # optimizer steps every stage applied
        self.idle: list[deque[Microbatch]] = [deque() for _ in range(K)]  # slots the pacing holds back
        self.idle_n, self.idle_since, self.idle_area = 0, 0.0, 0.0
        self.grad_bytes = cfg.stage_param_mb * 1e6
        # measurements
        self.update_times: list[tuple[float, float, float]] = []  # (applied at, round s, its all-reduce s)
        self.step_times: list[float] = []  # when the global optimizer step advanced
        self.failed_rounds = self.replays = self.batch_violations = 0

    # ---- trainers ----

    def _take(self, mb: Microbatch) -> bool:
        """Give the slot its next microbatch if the pacing allows it; else it waits (idle)."""
        i = mb.trainer
        bound = (self.seen_real + 1 + self.staleness) * self.real_shares[i] + self.slots[i] * self.b
        taken = None
        if self.k == 1 or self.started[i] + self.b <= bound + 1e-9:
            taken = self.pacers[i].take(self.seen_step, self.b_int, NO_TARGET)
        if taken is None:
            self._idle_change(+1)
            self.idle[i].append(mb)
            return False
        mb.tag, _, n = taken
        mb.n = float(n)
        self.started[i] += n
        return True

    def _idle_change(self, delta: int) -> None:
        self.idle_area += self.idle_n * (self.now - self.idle_since)
        self.idle_n += delta
        self.idle_since = self.now

    def _wake(self, trainer: int) -> None:
        """Slots of this trainer that the pacing held back start if it allows them now."""
        idle = self.idle[trainer]
        while idle:
            mb = idle.popleft()
            self._idle_change(-1)
            if not self._take(mb):
                idle.appendleft(idle.pop())  # still held back: it keeps its place
                return
            self._start_trip(mb)

    def _seen(self, steps: tuple[int, int]) -> None:
        """The trainers see the new global steps (Info polls of the stages' peers)."""
        sim_step, real_step = steps
        if sim_step > self.seen_step or real_step > self.seen_real:
            self.seen_step, self.seen_real = max(sim_step, self.seen_step), max(real_step, self.seen_real)
            for trainer in range(self.cfg.trainers):
                self._wake(trainer)

    # ---- stages ----

    def _contribute(self, peer: Peer, trainer: int, tag: int, n: float) -> None:
        """A backward on `peer` for step `tag` is done: the stage holds its gradient."""
        peer.held.setdefault(tag, []).append((trainer, n))
        k = peer.stage
        counts = self.counts[k]
        held = counts[tag] = counts.get(tag, 0.0) + n
        if tag == self.stage_step[k] and self.rounds[k] is None:
            if held >= (self.applied[k] + 1) * self.step_batch * (1 - 1e-9):
                self._maybe_begin(k)

    def _maybe_begin(self, k: int) -> None:
        """Start the round of the stage's next optimizer step if it holds that step's samples."""
        need = (self.applied[k] + 1) * self.step_batch
        if self.rounds[k] is not None or not self.serving[k]:
            return
        if self.counts[k].get(self.stage_step[k], 0.0) < need * (1 - 1e-9):
            return
        members = list(self.serving[k])
        self.tokens += 1
        allreduce, single = allreduce_seconds(members, self.grad_bytes, self._bandwidth), 0.0
        if len(members) > 1:  # notice (a watch's answer, or within a poll), agree (one RPC round), all-reduce
            latency = max(p.lat for p in members)
            notice = latency if self.poll[k].watched else self.sync_rng.uniform(0.0, self.poll[k].period_s)
            single = notice + 4 * latency + allreduce
        self.rounds[k] = (self.tokens, set(members), self.now)
        self._push(self.now + single, UPDATE, (k, self.tokens, allreduce))

    def _update(self, event: tuple[int, int, float]) -> None:
        """Stage k applies its next optimizer step (if the round was not broken meanwhile)."""
        k, token, allreduce = event
        current = self.rounds[k]
        if current is None or current[0] != token:
            return
        self.rounds[k] = None
        self.update_times.append((self.now, self.now - current[2], allreduce))
        self.applied[k] += 1
        if self.applied[k] == self.k:
            self._finish_sim_step(k)
        real = min(s * self.k + a for s, a in zip(self.stage_step, self.applied, strict=True))
        if real > self.real_step:
            self.real_step, self.global_step = real, min(self.stage_step)
            self.step_times.append(self.now)
            delay = self.sync_rng.uniform(0.0, self.poll[k].period_s)
            self._push(self.now + delay, SEEN, (self.global_step, self.real_step))
        self._maybe_begin(k)

    def _finish_sim_step(self, k: int) -> None:
        t = self.stage_step[k]
        held = self.counts[k].pop(t, 0.0)
        if abs(held - self.batch) > 1e-6 * self.batch:
            self.batch_violations += 1
        for p in self.serving[k]:
            p.held.pop(t, None)
        self.stage_step[k], self.applied[k] = t + 1, 0

    def _retry_round(self, k: int) -> None:
        self._maybe_begin(k)

    def _left_stage(self, peer: Peer, k: int, notice: float) -> None:
        """`peer` no longer serves stage k (dead or moved): the round under way fails, and the trainers
        replay, `notice` seconds from now, its part of what the stage has not applied yet."""
        current = self.rounds[k]
        if current is not None and peer in current[1]:
            self.rounds[k] = None
            self.failed_rounds += 1
            self._push(self.now + self.cfg.failure_timeout, RETRY_UPDATE, k)
        t, counts = self.stage_step[k], self.counts[k]
        for tag, contributions in peer.held.items():
            share = 1.0  # steps ahead: none of it is applied
            if tag == t and counts[t] > 0:
                share = max(0.0, counts[t] - self.applied[k] * self.step_batch) / counts[t]
            held: dict[int, float] = {}
            for trainer, n in contributions:
                held[trainer] = held.get(trainer, 0.0) + n
            for trainer, total in held.items():
                # whole microbatches where a share is lost (replays of the usual size route fastest)
                samples = total if share >= 1.0 else min(total, self.b * round(total * share / self.b))
                counts[tag] -= samples
                self._replay(k, tag, trainer, samples, notice)
        peer.held = {}

    def _replay(self, k: int, tag: int, trainer: int, samples: float, notice: float) -> None:
        """The trainer re-sends held backwards of stage k, in microbatches of at most the usual size."""
        S = self.cfg.stages
        hop = S - 1 if k == S - 1 else 2 * S - 2 - k  # the stage's backward hop
        while samples > 1e-9:
            mb = Microbatch(-1, trainer, hop, self.now)
            mb.tag, mb.n, mb.replay = tag, min(self.b, samples), True
            samples -= mb.n
            self.replays += 1
            self._push(self.now + notice, REPLAY, mb)

    def step_figures(self, start: float) -> dict[str, float]:
        """Mean seconds of an optimizer step's round (and of its all-reduce) for the rounds that ended
        after `start`, and seconds per global optimizer step."""
        rounds = [(d, a) for t, d, a in self.update_times if t >= start]
        steps = [t for t in self.step_times if t >= start]
        per_step = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else math.nan
        return {
            "update_s": sum(d for d, _ in rounds) / len(rounds) if rounds else math.nan,
            "allreduce_s": sum(a for _, a in rounds) / len(rounds) if rounds else math.nan,
            "step_s": per_step,
        }
