"""Churn and rebalancing in the simulator: preemptions (Poisson), new peers joining, the trainers'
views dropping dead peers, and swarm.peer.placement's rounds (plan_move, one move at most)."""

from __future__ import annotations

import logging

from swarm.policy.rebalance import plan_move
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
from swarm.sim.routing import set_online

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
        del self.present[peer]
        self.preemptions += 1
        self.placed[self._placed_stage(peer)] -= peer.thr
        in_view = peer.state in (ONLINE, DRAINING)
        self.draining -= peer.state == DRAINING
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
        self._drop_replica(peer)
        if in_view:
            del self.serving[peer.stage][peer]
            self._left_stage(peer, peer.stage, self.cfg.failure_timeout)
            self._push(self.now + self.cfg.dead_after + self.poll[peer.stage].period_s, REMOVE, peer)
        self._stage_changed(peer.stage)

    def _remove(self, peer: Peer) -> None:
        """The trainers' views drop the dead peer (it stopped answering Info)."""
        for load in peer.loads:
            self.router.remove(load)
            load.online = False

    def _join(self, _: None = None) -> None:
        cfg = self.cfg
        self._push(self.now + self.churn_rng.expovariate(cfg.join_rate * cfg.peers / SECONDS_PER_HOUR), JOIN, None)
        peer = self._new_peer()
        peer.state = JOINING
        peer.place(self._join_choice())
        peer.dst = peer.stage
        self.placed[peer.stage] += peer.thr
        self.joins += 1
        self._stage_changed(peer.stage)
        self._push(self.now + cfg.join_time, READY, peer)

    def _placed_stage(self, peer: Peer) -> int:
        """Where the peer counts for placement: a moving peer at its destination (as in swarm.peer.placement)."""
        return peer.dst if peer.state == DRAINING else peer.stage

    # ---- rebalancing ----

    def _rebalance(self, _: None = None) -> None:
        """One round of swarm.peer.placement's loop: plan_move on the current assignment, one move at most."""
        cfg, now, rng = self.cfg, self.now, self.rebalance_rng
        self._push(now + cfg.rebalance_period * rng.uniform(0.7, 1.3), REBALANCE, None)
        if self.draining:
            return  # a move is under way: let it settle first (as the real peers do)
        self.rounds_run += 1
        present = self.present  # the alive peers in the order they came: sorted by id, as plan_move sorts
        infos = [p.info for p in present]
        movable = dict.fromkeys((p.pid for p in present), False)
        for k in range(cfg.stages):
            for p in self._movable_sample(k):
                movable[p.pid] = True
        move = plan_move(infos, cfg.stages, cfg.rebalance_threshold, movable)
        if move is None:
            return
        peer = self.by_id[move.peer_id]
        peer.state, peer.dst = DRAINING, move.dst
        self.draining += 1
        self.placed[peer.stage] -= peer.thr
        self.placed[peer.dst] += peer.thr
        self.moves += 1
        self._record_changed()  # its record says it is draining
        logger.debug("t=%.0f move %s %d -> %d: %s", now, peer.pid, move.src, move.dst, move.reason)
        for load in peer.loads:
            set_online(load, False)
        self._maybe_finish_drain(peer)

    def _movable_sample(self, k: int) -> list[Peer]:
        """The peers of stage k offered to plan_move: online, placed at least move_cooldown ago; all of
        them, or `plan_candidates` at random (drawn by rejection from the stage's peers)."""
        cfg, now, rng = self.cfg, self.now, self.rebalance_rng
        peers = list(self.serving[k])
        n = cfg.plan_candidates
        if n and len(peers) > 4 * n:
            chosen: dict[Peer, None] = {}
            for _ in range(16 * n):
                p = peers[rng.randrange(len(peers))]
                if p.state == ONLINE and now - p.placed_at >= cfg.move_cooldown:
                    chosen[p] = None
                    if len(chosen) == n:
                        return list(chosen)
        eligible = [p for p in peers if p.state == ONLINE and now - p.placed_at >= cfg.move_cooldown]
        return eligible if not n or len(eligible) <= n else rng.sample(eligible, n)

    def _maybe_finish_drain(self, peer: Peer) -> None:
        """A draining peer leaves once its queue (and the work still on its way to it) is done; the
        trainers replay what it held for updates not applied yet once they see it gone."""
        if peer.running is not None or peer.queue or peer.transit:
            return
        src = peer.stage
        self.draining -= 1
        for load in peer.loads:
            self.router.remove(load)
        del self.serving[src][peer]
        self._stage_changed(src)
        self._left_stage(peer, src, self.poll[src].period_s)
        peer.state = MOVING
        peer.place(peer.dst)
        self._push(self.now + self.cfg.move_time, READY, peer)
