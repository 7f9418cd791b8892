"""What one simulated run is (SimConfig) and what it measured (RunResult).

Every option has a default that needs no tuning: the `None` ones are derived from the swarm's size in
`SimConfig.resolved()`, so that a run's cost (hops simulated) stays proportional to the peer count.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, fields, replace

from swarm.core.settings import DHT_REFRESH_S, INFO_PERIOD_S, LIVENESS_WINDOW_S
from swarm.core.states import SyncMode
from swarm.policy.polling import QUIET_FACTOR
from swarm.policy.rebalance import DEFAULT_THRESHOLD

logger = logging.getLogger(__name__)

POLICIES = ("ours", "uniform", "weighted")
INITIAL_LAYOUTS = ("join", "balanced", "random", "skewed")
SYNC_MODES = tuple(m.value for m in SyncMode)
POLLING_MODES = ("fixed", "budget")
SECONDS_PER_HOUR = 3600.0
# A run costs about 25 CPU-microseconds per hop (swarm.sim.routing keeps Wiring.choose's pick O(1) in
# Python), so: 100 hops per peer at least, 300,000 hops per run when the swarm is small, but hops no
# shorter than 3600 / MAX_HOPS_PER_PEER_HOUR seconds (else transfer latency, not compute, would fill them)
DEFAULT_HOPS_PER_PEER = 100.0
MIN_HOPS_PER_RUN = 300_000
MAX_HOPS_PER_PEER_HOUR = 3000.0
# the default global batch: this many seconds of the swarm's mean throughput per optimizer step
DEFAULT_STEP_SECONDS = 60.0


@dataclass(frozen=True)
class SimConfig:
    """One run. Throughputs are training samples/s (forward + backward) of a peer on one stage."""

    peers: int = 1000
    stages: int = 8
    sim_seconds: float = 3600.0
    policy: str = "ours"  # ours | uniform | weighted
    rebalance: bool = True
    seed: int = 0
    # peers: lognormal distributions given by median and sigma (of the underlying normal)
    throughput_median: float = 100.0
    throughput_sigma: float = 0.5
    bandwidth_median_mbps: float = 1000.0
    bandwidth_sigma: float = 0.5
    latency_median_ms: float = 30.0  # one way, per end of a transfer
    latency_sigma: float = 0.5
    compute_jitter: float = 0.1  # sigma of a lognormal factor (mean 1) on every task's compute time
    activation_kb: float = 64.0  # bytes sent per sample per hop (activations forward, gradients backward)
    # churn
    preemption_rate: float = 0.1  # fraction of the alive peers preempted per simulated hour (Poisson)
    join_rate: float | None = None  # arrivals per hour as a fraction of `peers` (default: preemption_rate)
    join_time: float = 10.0  # seconds a new peer needs (download, build) before it serves
    failure_timeout: float = 5.0  # seconds until a trainer notices that its call to a dead peer failed
    dead_after: float = LIVENESS_WINDOW_S  # seconds until the trainers' views drop a dead peer
    # trainers and microbatches
    trainers: int = 1  # independent trainer views (each knows only its own in-flight work)
    in_flight: int | None = None  # microbatches in flight over all trainers (default 2 per peer)
    microbatch_samples: float | None = None  # default: sized so that each peer serves ~hops_per_peer hops
    hops_per_peer: float | None = None  # default: 100, more for small swarms (at least 30,000 hops a run)
    report_running: bool = False  # peers' reported queue includes the task being computed
    check_routing: bool = False  # verify every fast routing pick against Wiring.choose (slow)
    # steps: every stage applies update t once it holds the global batch for t, then averages it
    sync: str = "async"  # async | exact (step t+1 starts only once every stage applied t)
    global_batch: float | None = None  # samples per optimizer step (default: DEFAULT_STEP_SECONDS of throughput)
    max_staleness: float = 1.0  # async: steps' worth of samples a trainer may start ahead (RunConfig's)
    ahead_after: float = 0.75  # async: share of a step done before the next one starts (RunConfig's)
    stage_param_mb: float = 100.0  # MB of gradient each peer of a stage all-reduces per step (fp16)
    # Info polls and DHT reads (swarm.cluster.view), and what they cost the peers that answer them
    # budget: each peer caps the polls it answers and the DHT reads stretch, as the code does
    # (swarm.policy.polling) | fixed: every info_period and dht_period, as the code did before
    # 2026-12-05 (then at 0.1 s and 2 s)
    polling: str = "budget"
    info_period: float = INFO_PERIOD_S  # s between two polls of one peer by one poller (the base, budget)
    info_cost_ms: float = 0.25  # CPU ms of one Info exchange at each end (scripts/bench_info.py: 0.24-0.41)
    info_bytes: float = 400.0  # bytes of one Info exchange (request, response, gRPC framing)
    info_budget: float = 100.0  # budget: Info answers per second one peer gives at most (5% of a core)
    dht_period: float = DHT_REFRESH_S  # s between two reads of every stage record by every process
    dht_record_bytes: float = 900.0  # bytes per peer in a stage record (signed: owner key and signature)
    dht_replicas: int = 5  # peers storing each stage record (hivemind's num_replicas)
    dht_budget_mbps: float = 50.0  # budget: Mbit/s one replica of a stage record serves at most
    # budget: the views' period after three reads without news (swarm.cluster.dht_reads); 1: always the base
    dht_quiet_factor: float = QUIET_FACTOR
    # rebalancing
    rebalance_period: float = 15.0  # seconds between rounds, jittered x0.7..1.3
    rebalance_threshold: float = DEFAULT_THRESHOLD  # plan_move's threshold, the peers' default
    move_time: float = 10.0  # seconds a moved peer needs before it serves its new stage
    move_cooldown: float = 60.0  # a peer that joined or moved this recently does not move
    plan_candidates: int | None = None  # movable peers offered to plan_move per stage (0: all)
    initial: str = "join"  # join | balanced | random | skewed
    # metrics
    warmup: float | None = None  # seconds left out of the averages (default: see summarize's warm_up)
    window: float | None = None  # seconds per point of the throughput series (default: run / 60)

    def validate(self) -> None:
        if self.stages < 1:
            raise ValueError("--stages must be at least 1")
        if self.peers < self.stages:
            raise ValueError(f"--peers ({self.peers}) must be at least --stages ({self.stages})")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; one of {', '.join(POLICIES)}")
        if self.initial not in INITIAL_LAYOUTS:
            raise ValueError(f"unknown initial layout {self.initial!r}; one of {', '.join(INITIAL_LAYOUTS)}")
        if self.sim_seconds <= 0 or self.trainers < 1 or (self.hops_per_peer is not None and self.hops_per_peer <= 0):
            raise ValueError("--sim-seconds, --trainers and --hops-per-peer must be positive")
        if self.compute_jitter < 0 or (self.in_flight is not None and self.in_flight < 1):
            raise ValueError("--compute-jitter must not be negative, --in-flight must be positive")
        if self.preemption_rate < 0 or (self.join_rate is not None and self.join_rate < 0):
            raise ValueError("rates must not be negative")
        self._validate_steps_and_polling()

    def _validate_steps_and_polling(self) -> None:
        if self.sync not in SYNC_MODES or self.polling not in POLLING_MODES:
            raise ValueError(f"--sync is one of {', '.join(SYNC_MODES)}, --polling one of {', '.join(POLLING_MODES)}")
        if self.global_batch is not None and self.global_batch < self.trainers:
            raise ValueError("--global-batch must give every trainer at least one sample per step")
        if not 0 <= self.max_staleness <= 16 or not 0 <= self.ahead_after <= 1:
            raise ValueError("--max-staleness must be in [0, 16] and --ahead-after in [0, 1]")
        costs = (self.stage_param_mb, self.info_cost_ms, self.info_bytes, self.dht_record_bytes)
        budgets = (self.info_period, self.dht_period, self.info_budget, self.dht_budget_mbps)
        if min(costs) < 0 or min(budgets) <= 0 or self.dht_replicas < 1:
            raise ValueError("costs must not be negative; periods, --info-budget and --dht-replicas must be positive")
        if not 1.0 <= self.dht_quiet_factor <= 100.0:
            raise ValueError(f"--dht-quiet-factor must be in [1, 100], got {self.dht_quiet_factor}")

    @property
    def hops_per_microbatch(self) -> int:
        """Forward on stages 0..S-2, one forward+backward call on the last stage, backward S-2..0."""
        return 2 * self.stages - 1

    @property
    def mean_throughput(self) -> float:
        return self.throughput_median * math.exp(self.throughput_sigma**2 / 2)

    def resolved(self) -> SimConfig:
        """Fill in the derived defaults."""
        self.validate()
        hops_per_peer = self.hops_per_peer
        if hops_per_peer is None:
            hops_per_peer = max(DEFAULT_HOPS_PER_PEER, MIN_HOPS_PER_RUN / self.peers)
            hops_per_peer = min(hops_per_peer, MAX_HOPS_PER_PEER_HOUR * self.sim_seconds / SECONDS_PER_HOUR)
        b = self.microbatch_samples
        if b is None:
            # hops per peer = sim_seconds * (peers / stages * mean throughput) / b * hops_per_mb / peers
            b = self.sim_seconds * self.mean_throughput * self.hops_per_microbatch / (self.stages * hops_per_peer)
            b = float(max(1, round(b)))
        in_flight = max(self.trainers, 2 * self.peers) if self.in_flight is None else self.in_flight
        batch = self.global_batch
        if batch is None:
            batch = max(self.trainers, round(DEFAULT_STEP_SECONDS * self.peers * self.mean_throughput / self.stages))
        return replace(
            self,
            join_rate=self.preemption_rate if self.join_rate is None else self.join_rate,
            in_flight=in_flight,
            global_batch=float(batch),
            microbatch_samples=b,
            hops_per_peer=hops_per_peer,
            plan_candidates=(0 if self.peers <= 48 else 1) if self.plan_candidates is None else self.plan_candidates,
            window=self.sim_seconds / 60 if self.window is None else self.window,
        )

    def label(self) -> str:
        return f"{self.policy} / rebalancing {'on' if self.rebalance else 'off'}"


@dataclass
class RunResult:
    """What a run measured; `summary()` is the part that goes into the JSON line and the table."""

    policy: str
    rebalance: bool
    peers: int
    stages: int
    sim_seconds: float
    microbatch_samples: float
    in_flight: int
    throughput: float  # samples/s completed, mean after warm-up
    ideal_throughput: float  # best_assignment_throughput of the alive peers, mean after warm-up
    throughput_fraction_of_ideal: float
    placement_fraction_of_ideal: float  # capacity of the current assignment / ideal (wiring excluded)
    latency_p50_s: float | None  # None when no microbatch made a whole trip after the warm-up
    latency_p99_s: float | None
    wasted_work_fraction: float  # compute spent on hops lost to preemptions / all compute
    retries: int  # hops re-sent after their peer died
    preemptions: int
    joins: int
    moves: int
    rebalance_rounds: int
    hops: int
    microbatches_completed: int
    lost_microbatches: int  # microbatches neither finished nor in flight at the end (must be 0)
    final_peers: int
    # steps: the barrier and the all-reduce
    sync: str = "async"
    polling: str = "budget"
    global_batch: float = 0.0
    steps_per_sim_step: int = 1  # optimizer steps one simulated step stands for (swarm.sim.steps)
    steps: int = 0  # the global step at the end (optimizer steps every stage applied)
    step_s: float | None = None  # mean seconds per global step after the warm-up
    update_s: float | None = None  # mean seconds from a stage holding the batch to applying it
    allreduce_s: float | None = None  # of which the all-reduce
    failed_rounds: int = 0  # update rounds broken by a member's death or departure
    replays: int = 0  # held backwards re-sent after their peer died or moved
    batch_violations: int = 0  # updates applied with other than global_batch samples (must be 0)
    pacing_idle_fraction: float = 0.0  # share of the trainers' in-flight slots the pacing held back
    # the ideal with what the peers would pay at the ideal assignment: polling CPU, and the rounds in exact mode
    ideal_with_overheads: float = 0.0
    fraction_of_ideal_with_overheads: float = 0.0
    overheads: dict[str, float] = field(default_factory=dict)  # polling figures, means after the warm-up
    route_fallbacks: int = 0  # picks the fast routing left to Wiring.choose
    warmup_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this run's CPU time: its cost, whatever else the machine is doing
    series: dict[str, list[float]] = field(default_factory=dict)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("series")
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 4)
        d["overheads"] = {k: round(v, 4) for k, v in self.overheads.items()}
        return d


CONFIG_FIELDS = tuple(f.name for f in fields(SimConfig))
