"""The run-peer daemon's settings: defaults and help text in one place; `swarm peer`'s options are
generated from them (swarm.core.settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from swarm.core.settings import setting
from swarm.policy.rebalance import DEFAULT_THRESHOLD
from swarm.training.averaging import AveragingConfig


@dataclass
class PeerConfig:
    run_id: str = setting(help="the run to join", metavar="RUN_ID")
    initial_peers: list[str] = setting(factory=list, help="DHT multiaddrs (the coordinator prints them)", cli=False)
    run_key: str | None = setting(None, "fingerprint of the run's key: only a config it signed is accepted", cli=False)
    invite: str | None = setting(None, "a private swarm's invitation file", cli=False)
    allow_model: list[str] = setting(
        factory=list,
        help="custom model factories (PKG.MODULE:FUNCTION) this process may import if the run config names one",
        metavar="FACTORY",
    )
    stage: str = setting("auto", "stage index to serve, or auto: the stage with the least total throughput")
    host: str = setting("127.0.0.1", "interface for gRPC and the DHT (0.0.0.0 for all)")
    port: int = setting(0, "gRPC port (0: any free port)")
    dht_port: int = setting(0, "DHT port (0: any free port)")
    lane_port: int = setting(
        0, "Forward/Backward over plain TCP beside gRPC, at this port (0: any free port; -1: off; open swarms only)"
    )
    announce_host: str | None = setting(
        None, "address other machines reach this peer at (public IP behind NAT, container IP; peers/README.md)"
    )
    identity_path: str | None = setting(
        None, "private key file (created if missing) that keeps this peer's id and record key across restarts"
    )
    check: bool = setting(
        False, "check this box (device, memory, ports, DHT, run config, throughput, reachability), then exit"
    )
    device: str = setting("auto", "auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    threads: int = setting(0, "torch intra-op threads (0: torch's default)")
    announce_period_s: float = setting(5.0, "seconds between DHT record refreshes (a state change is stored at once)")
    record_ttl_s: float = setting(15.0, "seconds a DHT record lives without refresh")
    # a backward accumulated here, a round of Info polls and a mate's freeze wake the check at once:
    # this period is only its fallback
    step_poll_s: float = setting(0.25, "seconds between checks whether the stage's pending update is due", cli=False)
    stall_report_s: float = setting(
        30.0, "a stage short of its global batch for this long says so in its log, events and status"
    )
    join_timeout_s: float = setting(60.0, "longest wait for the run config on the DHT at start")
    drain_timeout_s: float = setting(10.0, "longest wait for in-flight requests when leaving a stage or stopping")
    state_timeout_s: float = setting(120.0, "longest a state download from a stage-mate may take")
    max_message_mb: int = setting(256, "largest request accepted, in MiB")
    stream_read_timeout_s: float = setting(30.0, "a request stream that sends nothing for this long is cut")
    use_benchmark_cache: bool = setting(
        True, "reuse the cached throughput benchmark of this device, model and stage", flag="--benchmark-cache"
    )
    checkpoint_dir: str | None = setting(None, "write (one peer per stage) and restore checkpoints of stages here")
    checkpoint_every: int = setting(50, "steps between checkpoints")
    checkpoint_keep: int = setting(3, "checkpoints kept per stage")
    ledger_dir: str | None = setting(None, "also append this peer's ledger (applied updates and their samples) here")
    allow_reinit: bool = setting(
        False,
        "let a stage that lost every peer and checkpoint start again from its seeded initialization "
        "(without it the peer waits for a peer with the stage's state or a checkpoint)",
    )
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    rebalance: bool = setting(True, "move to the stage that slows the swarm down (--no-rebalance: never move)")
    rebalance_period_s: float = setting(15.0, "seconds between rebalancing checks (+-30% jitter)")
    rebalance_threshold: float = setting(
        DEFAULT_THRESHOLD, "a move must raise the slowest stage by this fraction of the mean peer's throughput"
    )
    move_cooldown_s: float = setting(60.0, "seconds after joining or moving before this peer moves (again)")
    events_ttl_s: float = setting(600.0, "seconds this peer's recent events stay on the DHT", cli=False)
    activation_cache_mb: int = setting(
        256, "MiB of forward activations kept for the same microbatch's backward here (0: always recompute)"
    )

    def __post_init__(self) -> None:
        if self.stage != "auto" and not str(self.stage).isdigit():
            raise ValueError(f"--stage must be a stage index or 'auto', got {self.stage!r}")
        if self.checkpoint_every < 1:
            raise ValueError("--checkpoint-every must be >= 1")
        if self.activation_cache_mb < 0:
            raise ValueError("--activation-cache-mb must be >= 0 (0 turns the cache off)")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb << 20

    @property
    def max_state_bytes(self) -> int:
        """A stage's state (parameters and optimizer moments, about 3x the parameters) may exceed one
        request's limit: downloads accept up to 4x it."""
        return 4 * self.max_message_bytes
