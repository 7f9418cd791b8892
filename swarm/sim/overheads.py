"""What keeping the views fresh costs the peers: Info polls and DHT reads (swarm.cluster.view).

Every process keeps a SwarmView. A peer polls its stage-mates' Info every `info_period` (0.1 s), a
trainer polls every peer's, and every process reads all S stage records from the DHT every
`dht_period` (2 s). With n peers on a stage and T trainers, one peer therefore answers
(n - 1 + T) / info_period polls per second and makes (n - 1) / info_period of its own; each
exchange costs it `info_cost_ms` of CPU and `info_bytes` on its link. A stage record holds n signed
entries of `dht_record_bytes`, and each one is stored on `dht_replicas` peers, which answer all
(peers + trainers) / dht_period reads of it. The model turns these rates into:

* a CPU share u taken from the peer's compute: its tasks run at throughput x (1 - u), at least
  MIN_CPU_SHARE (the Info handler, the DHT node and the compute loop share one process);
* link load subtracted from its bandwidth, down to MIN_LINK_SHARE of it, for activations and
  all-reduce alike;
* how stale the views are: the stage-mates learn that a stage holds its global batch, and the
  trainers that a stage applied an update, within one poll period (drawn uniformly).

A peer with at most WATCH_MAX_MATES stage-mates watches them instead (swarm.cluster.watch, the code
since 2026-12-07): one long poll per mate, answered once per change of the mate's count (one per
microbatch it accumulates, `mate_changes_s`) and once per WATCH_WAIT_S without one. The mates then
learn that their stage holds its batch within one one-way latency, not a poll period.

* how late the trainers learn of a peer: a peer that comes online (joined or moved) is added to
  the trainers' views after a uniform draw within one DHT period, and a dead one dropped after
  `dead_after` plus one Info period (the last answer can be a period old).

Under `polling="budget"` the views also read less while the records do not change, as the code's do
(swarm.cluster.dht_reads, since 2026-12-07): `dht_quiet_factor` times the period after three reads in
a row without news. The news is every change of a stage's membership (a join, a peer online, a
preemption, a move), counted over the last CHANGES_WINDOW_S; `swarm.policy.dht_read_rhythm` turns its
rate into the mean period (what the replicas serve) and the share of time the views spend in
stretched periods (a new peer waits a draw within the stretched period with that probability). A peer
that comes online where microbatches wait for a usable peer of its stage is found within MIN_GAP_S:
the trainers' views ask for a read at once then.

`polling="budget"` (the default) is what the code does (swarm.policy.polling, the same functions):
each peer answers at most `info_budget` Info polls per second (its pollers stretch their period to
pollers / budget) and every process stretches its DHT period so that no replica serves more than
`info_budget` reads or `dht_budget_mbps` per second. Costs fall; staleness grows. `polling="fixed"`
is the code before that: fixed periods whatever the swarm's size. All rates are steady-state
figures of the current stage sizes, recomputed whenever a stage changes. The trainers' view of a
peer's queue stays current either way (hops last seconds to minutes here, longer than any poll
period).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from swarm.policy.polling import (
    MIN_GAP_S,
    QUIET_AFTER,
    WATCH_WAIT_S,
    dht_period,
    dht_read_rhythm,
    info_period,
    watches_mates,
)

MIN_CPU_SHARE = 0.02  # a peer drowned in polls still computes this share of its throughput
MIN_LINK_SHARE = 0.05
CHANGES_WINDOW_S = 300.0  # the rate of record changes the views see: counted over this long


@dataclass(frozen=True)
class PollLoad:
    """Steady-state polling figures of one peer on a stage of n peers, with T trainers."""

    answers_s: float  # Info polls it answers per second
    polls_s: float  # Info polls of its stage-mates it makes per second
    period_s: float  # how often each poller refreshes its view of this peer
    cpu_share: float  # CPU share of all its Info exchanges
    link_bps: float  # bytes/s on its link
    watched: bool = False  # its mates watch it (and it them): they learn of its count at once

    @property
    def exchanges_s(self) -> float:
        return self.answers_s + self.polls_s


def poll_load(n: int, trainers: int, cfg, mate_changes_s: float = 0.0) -> PollLoad:
    """Info traffic of one peer among n stage-mates (itself included) polled by `trainers` trainers;
    `mate_changes_s`: how often one peer's accumulated count changes (its microbatches a second)."""
    mates = max(0, n - 1)
    watched = cfg.polling == "budget" and watches_mates(mates)
    pollers = trainers if watched else mates + trainers
    period = cfg.info_period
    if cfg.polling == "budget":
        period = info_period(pollers, period, cfg.info_budget)
    watch_s = mates * (1 / WATCH_WAIT_S + mate_changes_s) if watched else 0.0  # answered and asked alike
    answers, polls = pollers / period + watch_s, (watch_s if watched else mates / period)
    return PollLoad(
        answers_s=answers,
        polls_s=polls,
        period_s=period,
        cpu_share=(answers + polls) * cfg.info_cost_ms / 1000,
        link_bps=(answers + polls) * cfg.info_bytes,
        watched=watched,
    )


@dataclass(frozen=True)
class DhtLoad:
    """The DHT reads of stage records: per replica of one record, and per reader."""

    period_s: float  # the base period each process re-reads every stage record at (budgeted)
    replica_reads_s: float  # reads of one record that one of its replicas serves per second
    replica_cpu_share: float
    replica_link_bps: float
    reader_link_bps: float  # bytes/s every process downloads
    mean_read_s: float  # between two reads of a view, quiet periods included
    quiet_share: float  # of the time a view reads at the stretched period
    quiet_period_s: float  # the stretched period


def dht_load(alive: int, trainers: int, stages: int, cfg, changes_per_s: float = 0.0) -> DhtLoad:
    """The DHT figures of `alive` peers and `trainers` trainers when the stage records change
    `changes_per_s` times a second (swarm-wide)."""
    readers = alive + trainers
    period = mean = quiet_period = cfg.dht_period
    quiet_share = 0.0
    record = alive / max(1, stages) * cfg.dht_record_bytes  # one stage's record: all its peers' entries
    if cfg.polling == "budget":
        period = dht_period(readers, record, period, cfg.dht_replicas, cfg.info_budget, cfg.dht_budget_mbps * 1e6 / 8)
        rhythm = dht_read_rhythm(period, changes_per_s, QUIET_AFTER, cfg.dht_quiet_factor)
        mean, quiet_share, quiet_period = rhythm.mean_s, rhythm.quiet_share, period * cfg.dht_quiet_factor
    reads = readers / mean / cfg.dht_replicas
    return DhtLoad(
        period_s=period,
        replica_reads_s=reads,
        replica_cpu_share=reads * cfg.info_cost_ms / 1000,
        replica_link_bps=reads * record,
        reader_link_bps=stages * record / mean,
        mean_read_s=mean,
        quiet_share=quiet_share,
        quiet_period_s=quiet_period,
    )


def trainer_load(alive: int, cfg, poll: PollLoad) -> tuple[float, float]:
    """(Info polls per second, CPU cores they take) of one trainer polling every alive peer."""
    polls = alive / poll.period_s
    return polls, polls * cfg.info_cost_ms / 1000


class Overheads:
    """Mixed into swarm.sim.engine.Simulator: the per-stage and per-replica loads, kept current."""

    def _init_overheads(self) -> None:
        S = self.cfg.stages
        self.poll = [poll_load(0, self.cfg.trainers, self.cfg) for _ in range(S)]
        self.cpu_free = [1.0] * S  # compute share left by the Info exchanges of a stage's peers
        self.link_used = [0.0] * S  # bytes/s of Info traffic per peer of the stage
        self.dht = dht_load(0, self.cfg.trainers, S, self.cfg)
        self.replicas: list[list] = [[] for _ in range(S)]  # the peers storing each stage's record
        self.record_changes: deque[float] = deque()  # when a stage record changed, within CHANGES_WINDOW_S

    def _record_changed(self) -> None:
        """A stage record changed (news to every view's DHT reads)."""
        self.record_changes.append(self.now)

    def _refresh_dht(self) -> None:
        """The DHT figures at the current size and rate of record changes."""
        changes = self.record_changes
        while changes and changes[0] < self.now - CHANGES_WINDOW_S:
            changes.popleft()
        rate = len(changes) / CHANGES_WINDOW_S
        self.dht = dht_load(len(self.alive), self.cfg.trainers, self.cfg.stages, self.cfg, rate)

    def _discovery_delay(self, stage: int) -> float:
        """How long until the trainers' views read a new or moved peer of `stage` from the DHT: a uniform
        draw within the period the views are in (the stretched one with the share of time they spend in
        it), or within MIN_GAP_S when microbatches wait for a usable peer of the stage (the trainers'
        views ask for a read then: swarm.cluster.dht_reads)."""
        if self.waiting[stage] and self.cfg.polling == "budget":
            return self.sync_rng.uniform(0.0, MIN_GAP_S)
        d = self.dht
        if d.quiet_share > 0 and self.sync_rng.random() < d.quiet_share:
            return self.sync_rng.uniform(0.0, d.quiet_period_s)
        return self.sync_rng.uniform(0.0, d.period_s)

    def _stage_changed(self, k: int) -> None:
        """Stage k gained or lost a serving peer: recompute its peers' polling load (and the DHT's)."""
        cfg = self.cfg
        n = len(self.serving[k])
        changes = sum(p.thr for p in self.serving[k]) / max(1, n) / self.b  # one peer's microbatches a second
        p = self.poll[k] = poll_load(n, cfg.trainers, cfg, changes)
        self.cpu_free[k] = 1.0 - p.cpu_share
        self.link_used[k] = p.link_bps
        self._record_changed()
        self._refresh_dht()

    def _cpu_share(self, peer) -> float:
        free = self.cpu_free[peer.stage] - peer.replica_of * self.dht.replica_cpu_share
        return free if free > MIN_CPU_SHARE else MIN_CPU_SHARE

    def _bandwidth(self, peer) -> float:
        bw = peer.bw
        free = bw - self.link_used[peer.stage] - peer.replica_of * self.dht.replica_link_bps
        return free if free > MIN_LINK_SHARE * bw else MIN_LINK_SHARE * bw

    def _place_replicas(self) -> None:
        """Every stage record gets `dht_replicas` replicas among the alive peers (hivemind stores a key
        on the nodes nearest to it: as good as random peers here); a dead replica is replaced."""
        for holders in self.replicas:
            while len(holders) < min(self.cfg.dht_replicas, len(self.alive)):
                p = self.alive[self.replica_rng.randrange(len(self.alive))]
                if p in holders:
                    continue
                holders.append(p)
                p.replica_of += 1

    def _drop_replica(self, peer) -> None:
        if peer.replica_of:
            for holders in self.replicas:
                if peer in holders:
                    holders.remove(peer)
            peer.replica_of = 0
            self._place_replicas()

    def _overhead_snapshot(self) -> dict[str, float]:
        """This moment's polling figures: means over the serving peers, the DHT replicas', a trainer's,
        and the CPU share the ideal assignment's peers would pay (stages of alive / S peers)."""
        cfg = self.cfg
        sizes = [len(s) for s in self.serving]
        serving = max(1, sum(sizes))

        def mean(field: str) -> float:
            return sum(getattr(p, field) * n for p, n in zip(self.poll, sizes, strict=True)) / serving

        balanced = poll_load(round(len(self.alive) / cfg.stages), cfg.trainers, cfg)
        trainer_polls, trainer_cores = trainer_load(len(self.alive), cfg, balanced)
        return {
            "info_answers_s": mean("answers_s"),
            "info_polls_s": mean("polls_s"),
            "info_period_s": mean("period_s"),
            "info_cpu_share": mean("cpu_share"),
            "info_link_mbps": mean("link_bps") * 8 / 1e6,
            "dht_period_s": self.dht.period_s,
            "dht_mean_read_s": self.dht.mean_read_s,
            "dht_quiet_share": self.dht.quiet_share,
            "dht_replica_reads_s": self.dht.replica_reads_s,
            "dht_replica_link_mbps": self.dht.replica_link_bps * 8 / 1e6,
            "dht_reader_link_mbps": self.dht.reader_link_bps * 8 / 1e6,
            "trainer_info_polls_s": trainer_polls,
            "trainer_info_cores": trainer_cores,
            "ideal_cpu_share": max(MIN_CPU_SHARE, 1.0 - balanced.cpu_share),
        }
