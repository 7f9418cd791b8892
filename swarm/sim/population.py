"""Who is in the simulated swarm: the peers present at the start and those that join, where they
serve, when the trainers' views list them; and the microbatches in flight at the start."""

from __future__ import annotations

import itertools
import math

from swarm.policy.rebalance import join_stage
from swarm.sim.config import SECONDS_PER_HOUR
from swarm.sim.entities import DEAD, DISCOVER, JOIN, ONLINE, POLL, REBALANCE, TICK, Microbatch, Peer

STARTED_BEFORE = -1.0  # t0 of the microbatches in flight at the start (mid-way through the pipeline)


class Population:
    """Mixed into swarm.sim.engine.Simulator."""

    def _new_peer(self) -> Peer:
        cfg, rng = self.cfg, self.pop_rng
        thr = rng.lognormvariate(math.log(cfg.throughput_median), cfg.throughput_sigma)
        bw = rng.lognormvariate(math.log(cfg.bandwidth_median_mbps * 1e6 / 8), cfg.bandwidth_sigma)
        lat = rng.lognormvariate(math.log(cfg.latency_median_ms / 1000), cfg.latency_sigma)
        peer = Peer(self.next_idx, thr, bw, lat, cfg.trainers)
        self.next_idx += 1
        self.by_id[peer.pid] = peer
        self.alive.append(peer)
        self.present[peer] = None
        return peer

    def _join_choice(self) -> int:
        """A joining peer's stage: join_stage with rebalancing on (as real peers do), random otherwise."""
        if self.cfg.rebalance:
            return join_stage(self.placed, self.stage_rng)
        return self.stage_rng.randrange(self.cfg.stages)

    def _init_peers(self) -> None:
        """The peers present at t=0, placed by `initial` ("join": one by one, as later joiners are)."""
        cfg, S = self.cfg, self.cfg.stages
        totals = [0.0] * S
        peers: list[Peer] = []
        for i in range(cfg.peers):
            p = self._new_peer()
            if cfg.initial == "join" and cfg.rebalance:
                p.stage = join_stage(totals, self.stage_rng)
            elif cfg.initial in ("join", "random"):
                p.stage = self.stage_rng.randrange(S)
            elif cfg.initial == "skewed":  # one peer on every stage, all the others on stage 0
                p.stage = i if i < S else 0
            totals[p.stage] += p.thr
            peers.append(p)
        if cfg.initial == "balanced":  # largest first onto the weakest stage: a near-optimal layout
            totals = [0.0] * S
            for p in sorted(peers, key=lambda q: -q.thr):
                p.stage = join_stage(totals, self.stage_rng)
                totals[p.stage] += p.thr
        for p in peers:
            p.place(p.stage)
            p.dst = p.stage
            self.placed[p.stage] += p.thr
            self._go_online(p, placed_at=-math.inf)
        self._place_replicas()
        if cfg.preemption_rate > 0:
            self._schedule_preemption()
        if cfg.join_rate > 0:
            self._push(self.churn_rng.expovariate(cfg.join_rate * cfg.peers / SECONDS_PER_HOUR), JOIN, None)
        if cfg.rebalance:
            self._push(cfg.rebalance_period * self.rebalance_rng.uniform(0.7, 1.3), REBALANCE, None)
        self._push(cfg.window, TICK, 0)

    def _init_microbatches(self) -> None:
        """Spread over the pipeline, as in steady state, rather than all at stage 0 (a warm-up of a whole
        trip). They count in full when they complete: the run starts from a snapshot of a swarm at work.
        A microbatch that starts past some backward hops left its gradient on a peer of those stages."""
        cfg, H = self.cfg, 2 * self.cfg.stages - 1
        hops = range(H)
        holders = [list(peers) for peers in self.serving]
        cum = list(itertools.accumulate(self.hop_unit))
        for i in range(cfg.in_flight):
            # where a microbatch spends its time: on the hops that take longest (backward, last stage)
            hop = self.mb_rng.choices(hops, cum_weights=cum)[0]
            mb = Microbatch(i, i % cfg.trainers, hop, STARTED_BEFORE)
            if not self._take(mb):
                continue
            for done in range(cfg.stages - 1, hop):
                self._contribute(self.mb_rng.choice(holders[self.hop_stage[done]]), mb.trainer, mb.tag, mb.n)
            if mb.hop > 0:
                mb.sender = self.mb_rng.choice(self.alive)  # some peer held its activations
            self._send(mb)

    def _go_online(self, peer: Peer, placed_at: float) -> None:
        """The peer serves its stage: its mates count it at once, the trainers once they read the DHT
        (the peers present at the start are known from the start)."""
        peer.state, peer.placed_at = ONLINE, placed_at
        self.serving[peer.stage][peer] = None
        for load in peer.loads:
            load.stage, load.online, load.in_flight, load.reported_queue = peer.stage, False, 0.0, 0.0
        self._stage_changed(peer.stage)
        self._maybe_begin(peer.stage)
        if placed_at == -math.inf:
            self._discover((peer, peer.stage))
        else:
            self._push(self.now + self._discovery_delay(peer.stage), DISCOVER, (peer, peer.stage))

    def _discover(self, found: tuple[Peer, int]) -> None:
        """The trainers' views list the peer (if it still serves that stage)."""
        peer, stage = found
        if peer.state != ONLINE or peer.stage != stage or peer.loads[0].online:
            return
        for t, load in enumerate(peer.loads):
            load.online = True
            self.router.add(t, load)
        if self.waiting[stage] and not self.poll_pending[stage]:
            self.poll_pending[stage] = True
            self._push(self.now, POLL, stage)

    def _ready(self, peer: Peer) -> None:
        if peer.state != DEAD:
            self._go_online(peer, self.now)
