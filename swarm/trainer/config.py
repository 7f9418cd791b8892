"""The trainer's settings: defaults and help text in one place; `swarm trainer`'s options are
generated from them (swarm.core.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.core.settings import setting


@dataclass
class TrainerConfig:
    run_id: str = setting(help="the run to join", metavar="RUN_ID")
    initial_peers: list[str] = setting(factory=list, help="DHT multiaddrs (the coordinator prints them)", cli=False)
    run_key: str | None = setting(None, "fingerprint of the run's key: only a config it signed is accepted", cli=False)
    invite: str | None = setting(None, "a private swarm's invitation file", cli=False)
    allow_model: list[str] = setting(
        factory=list,
        help="custom model factories (PKG.MODULE:FUNCTION) this process may import if the run config names one",
        metavar="FACTORY",
    )
    steps: int = setting(60, "train until the swarm has applied this many optimizer steps")
    trainer_index: int = setting(0, "this trainer's data shard")
    num_trainers: int | None = setting(None, "number of data shards (default: the run config's)")
    max_in_flight: int = setting(8, "microbatches in flight at once")
    max_retries: int = setting(8, "retries of one forward call before its microbatch is started again")
    min_deadline_s: float = setting(5.0, "seconds every call gets at least")
    deadline_factor: float = setting(4.0, "a call's deadline: the minimum plus this times its expected finish time")
    stage_wait_s: float = setting(180.0, "longest wait for a stage to have a usable peer", flag="--stage-wait-timeout")
    join_timeout_s: float = setting(60.0, "longest wait for the run config on the DHT at start")
    val_every: int = setting(20, "validation every N global steps (trainer 0; 0 disables)")
    val_samples: int = setting(64, "validation samples")
    seed: int = setting(0, "this trainer's random seed (routing ties)", cli=False)
    threads: int = setting(0, "torch intra-op threads (0: torch's default)")
    host: str = setting("127.0.0.1", "interface for the trainer's DHT node")
    json_progress: bool = setting(False, "print a parseable progress line per step on stdout")
    progress_bar: bool = setting(True, "show a progress bar on a terminal")
    sample_log: str | None = setting(
        None, "append every microbatch's step and sample indices to this JSON-lines file ({trainer}: the index)"
    )
    spot_check: float = setting(
        0.05, "fraction of forward and backward answers recomputed on a stage-mate to catch lying peers (0: none)"
    )
    spot_check_tolerance: float | None = setting(
        None, "relative difference two honest answers may show (default: by codec and sync mode)"
    )
    stream_threshold_kb: int = setting(2048, "requests with more tensor data than this many KiB are streamed")
    leave_out_kept_inputs: bool = setting(
        True,
        "a backward sent back to the peer that ran its forward and keeps its activations goes without the stage "
        "input (a middle stage's backward: half the bytes); off: always send it",
    )
    lane: bool = setting(
        True, "send Forward/Backward over a peer's lane (plain TCP) when it offers one (open swarms); else gRPC"
    )
