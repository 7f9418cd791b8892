"""Churn and rebalancing in the simulator: preemptions (Poisson), new peers joining, the trainers'
views dropping dead peers, and swarm.peer.placement's rounds (plan_move, one move at most)."""

from __future__ import annotations

import logging

from swarm.policy.rebalance import PeerInfo, plan_move
from swarm.sim.config import SECONDS_PER_HOUR
from swarm.sim.entities import (
    DEAD,
    DRAINING,
    FAIL,
    JOIN,
    JOINING,
    MOVING,
    ONLINE,
    PREEMPT,
    READY,
    REBALANCE,
    REMOVE,
    Peer,
)

logger = logging.getLogger(__name__)


class Churn:
    """Mixed into swarm.sim.engine.Simulator (its state and event queue)."""

    def _schedule_preemption(self) -> None:
        rate = self.cfg.preemption_rate * max(1, len(self.alive)) / SECONDS_PER_HOUR
        self._push(self.now + self.churn_rng.expovariate(rate), PREEMPT, None)

    def _preempt(self, _: None = None) -> None:
        """A uniformly random alive peer vanishes with everything it was working on."""
        self._schedule_preemption()
        if not self.alive:
            return
        i = self.churn_rng.randrange(len(self.alive))
        peer = self.alive[i]
        self.alive[i] = self.alive[-1]
        self.alive.pop()
        self.preemptions += 1
        in_view = peer.state in (ONLINE, DRAINING)
        peer.state = DEAD
        lost = list(peer.queue) + list(peer.transit)
        if peer.running is not None:
            lost.append(peer.running)
            self.wasted_compute += self.now - peer.run_start
        for task in lost:
            task.lost = True
            self.failing.add(task)
            self._push(self.now + self.cfg.failure_timeout, FAIL, task)
        peer.queue.clear()
        peer.transit.clear()
        peer.running = None
        if in_view:
            self._push(self.now + self.cfg.dead_after, REMOVE, peer)

    def _remove(self, peer: Peer) -> None:
        """The trainers' views drop the dead peer (it stopped answering Info)."""
        for t, load in enumerate(peer.loads):
            self.views[t][peer.stage].remove(load)
        self.views_version += 1

    def _join(self, _: None = None) -> None:
        cfg = self.cfg
        self._push(self.now + self.churn_rng.expovariate(cfg.join_rate * cfg.peers / SECONDS_PER_HOUR), JOIN, None)
        peer = self._new_peer()
        peer.state = JOINING
        peer.stage = peer.dst = self._join_choice()
        self.joins += 1
        self._push(self.now + cfg.join_time, READY, peer)

    def _placed_stage(self, peer: Peer) -> int:
        """Where the peer counts for placement: a moving peer at its destination (as in swarm.peer.placement)."""
        return peer.dst if peer.state == DRAINING else peer.stage

    def _stage_totals(self) -> list[float]:
        totals = [0.0] * self.cfg.stages
        for p in self.alive:
            totals[self._placed_stage(p)] += p.thr
        return totals

    # ---- rebalancing ----

    def _rebalance(self, _: None = None) -> None:
        """One round of swarm.peer.placement's loop: plan_move on the current assignment, one move at most."""
        cfg, now, rng = self.cfg, self.now, self.rebalance_rng
        self._push(now + cfg.rebalance_period * rng.uniform(0.7, 1.3), REBALANCE, None)
        if any(p.state == DRAINING for p in self.alive):
            return  # a move is under way: let it settle first (as the real peers do)
        self.rounds += 1
        infos, movable = [], {}
        candidates: list[list[str]] = [[] for _ in range(cfg.stages)]
        for p in self.alive:
            infos.append(PeerInfo(p.pid, p.stage, p.thr))
            movable[p.pid] = False
            if p.state == ONLINE and now - p.placed_at >= cfg.move_cooldown:
                candidates[p.stage].append(p.pid)
        for stage_candidates in candidates:
            k = cfg.plan_candidates
            chosen = stage_candidates if k == 0 or len(stage_candidates) <= k else rng.sample(stage_candidates, k)
            for pid in chosen:
                movable[pid] = True
        move = plan_move(infos, cfg.stages, cfg.rebalance_threshold, movable)
        if move is None:
            return
        peer = self.by_id[move.peer_id]
        peer.state, peer.dst = DRAINING, move.dst
        self.moves += 1
        logger.debug("t=%.0f move %s %d -> %d: %s", now, peer.pid, move.src, move.dst, move.reason)
        for load in peer.loads:
            load.online = False
        self._maybe_finish_drain(peer)

    def _maybe_finish_drain(self, peer: Peer) -> None:
        """A draining peer leaves once its queue (and the work still on its way to it) is done."""
        if peer.running is not None or peer.queue or peer.transit:
            return
        for t, load in enumerate(peer.loads):
            self.views[t][peer.stage].remove(load)
        self.views_version += 1
        peer.state, peer.stage = MOVING, peer.dst
        self._push(self.now + self.cfg.move_time, READY, peer)
