"""The `swarm` command: coordinator, peer, trainer, local (and the tools built on them)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid

from swarm.core.log import setup_logging

logger = logging.getLogger("swarm.cli")

MODEL_PRESETS = {
    "gpt": None,  # swarm.config.DEFAULT_MODEL
    "gpt-small": {
        "kind": "gpt",
        "vocab_size": 256,
        "seq_len": 128,
        "d_model": 256,
        "n_layers": 8,
        "n_heads": 8,
        "d_ff": 1024,
    },
    "mlp": {"kind": "mlp", "in_dim": 32, "hidden": 64, "n_layers": 4, "n_classes": 10},
}

EPILOG = """\
A local demo:       swarm local
Several terminals:  swarm coordinator --run-id demo          (prints the --initial-peers to use)
                    swarm peer --run-id demo --initial-peers /ip4/127.0.0.1/tcp/PORT/p2p/ID
                    swarm trainer --run-id demo --initial-peers ... --steps 100
"""


def _install_uvloop() -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency
        pass


def add_join_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-id", required=True, help="the run to join")
    p.add_argument(
        "--initial-peers", nargs="+", metavar="MULTIADDR", help="DHT multiaddrs (the coordinator prints them)"
    )
    p.add_argument(
        "--initial-peers-file",
        metavar="PATH",
        help="read the multiaddrs from this file (the coordinator's --maddrs-file), waiting for it to appear",
    )


def initial_peers(args: argparse.Namespace, timeout: float = 120.0) -> list[str]:
    """--initial-peers, or the lines of --initial-peers-file once it exists."""
    if args.initial_peers:
        return list(args.initial_peers)
    path = getattr(args, "initial_peers_file", None)
    if not path:
        raise SystemExit("give --initial-peers MULTIADDR... or --initial-peers-file PATH")
    deadline = time.monotonic() + timeout
    while True:
        try:
            peers = [line.strip() for line in open(path) if line.strip()]
            if peers:
                return peers
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear (or stayed empty) within {timeout:.0f} s")
        time.sleep(0.5)


def add_run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run configuration (published on the DHT by the coordinator)")
    g.add_argument("--config", help="a run config JSON file (other run options override its fields)")
    g.add_argument("--model", default="gpt", help="preset (gpt, gpt-small, mlp) or a JSON model spec")
    g.add_argument(
        "--custom-model",
        metavar="PKG.MODULE:BUILD_STAGES",
        help="your own model: build_stages(num_stages=S) -> list of stage modules",
    )
    g.add_argument(
        "--dataset", choices=["stdlib", "text", "tokens", "synthetic"], help="default: stdlib (synthetic for mlp)"
    )
    g.add_argument("--data-path", help="folder of text files (text) or uint16 .bin token file (tokens)")
    g.add_argument("--global-batch", type=int, help="samples per optimizer step (default 32)")
    g.add_argument("--microbatch", type=int, help="samples per microbatch (default 8)")
    g.add_argument(
        "--codec",
        choices=["none", "fp16", "bf16", "int8"],
        help="compression of activations and gradients (default fp16)",
    )
    g.add_argument(
        "--sync",
        choices=["async", "exact"],
        help="exact: step t+1 starts after every stage applied step t (default async)",
    )
    g.add_argument(
        "--max-staleness",
        type=float,
        help="async: how far a trainer may run ahead of the slowest stage, in steps' worth of samples; "
        "fractions allowed (0.5: half of the next step's microbatches start early; default 1)",
    )
    g.add_argument(
        "--ahead-after",
        type=float,
        help="async: share of a trainer's samples of a step that must be done before it starts samples "
        "of the next step while that step is pending (default 0.75; 0: start as soon as the bound allows)",
    )
    g.add_argument(
        "--predict-params",
        action=argparse.BooleanOptionalAction,
        help="async: compute microbatches meant for a pending update at the parameters that update is "
        "expected to give, not the current ones (default on; --no-predict-params for plain staleness)",
    )
    g.add_argument("--lr", type=float, help="peak learning rate (default 3e-3)")
    g.add_argument("--warmup-steps", type=int, help="linear warmup steps (default 5)")
    g.add_argument("--total-steps", type=int, help="cosine schedule length (default: --steps for local, else 1000)")
    g.add_argument(
        "--clip-norm", type=float, help="per-stage gradient clipping of the averaged gradient; 0 disables (default 1.0)"
    )
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0)")
    g.add_argument("--seed", type=int, help="model initialization and data order seed (default 0)")


def build_run_config(args: argparse.Namespace, run_id: str, stages: int, num_trainers: int, steps: int | None = None):
    from swarm.training.config import DEFAULT_MODEL, OptimConfig, RunConfig
    from swarm.training.data import DataConfig

    base: dict = {}
    if args.config:
        with open(args.config) as f:
            base = json.load(f)
    if args.custom_model:
        model = {"kind": "custom", "factory": args.custom_model}
    elif args.model in MODEL_PRESETS:
        model = dict(MODEL_PRESETS[args.model] or DEFAULT_MODEL)
    else:
        try:
            model = json.loads(args.model)
        except ValueError:
            raise SystemExit(
                f"--model must be one of {sorted(MODEL_PRESETS)} or a JSON spec, got {args.model!r}"
            ) from None
    if args.config and args.model == "gpt" and not args.custom_model and "model" in base:
        model = base["model"]
    if args.seed is not None and model.get("kind") != "custom":
        model["seed"] = args.seed
    data = dict(base.get("data", {}))
    if args.dataset:
        data["kind"] = args.dataset
    elif model.get("kind") == "mlp" and "kind" not in data:
        data["kind"] = "synthetic"
    if args.data_path:
        data["path"] = args.data_path
    if args.seed is not None:
        data["seed"] = args.seed
    optim = dict(base.get("optim", {}))
    for arg, key in (
        ("lr", "lr"),
        ("warmup_steps", "warmup_steps"),
        ("total_steps", "total_steps"),
        ("clip_norm", "clip_norm"),
        ("weight_decay", "weight_decay"),
    ):
        if getattr(args, arg) is not None:
            optim[key] = getattr(args, arg)
    if "total_steps" not in optim and steps is not None:
        optim["total_steps"] = max(1, steps)
    fields = {
        k: v for k, v in base.items() if k not in ("model", "data", "optim", "run_id", "num_stages", "num_trainers")
    }
    for arg in ("global_batch", "microbatch", "codec", "sync", "max_staleness", "ahead_after", "predict_params"):
        if getattr(args, arg) is not None:
            fields[arg] = getattr(args, arg)
    try:
        return RunConfig(
            run_id=run_id,
            num_stages=stages,
            model=model,
            data=DataConfig(**data),
            optim=OptimConfig(**optim),
            num_trainers=num_trainers,
            **fields,
        )
    except (TypeError, ValueError) as e:
        raise SystemExit(f"invalid run configuration: {e}") from None


def add_peer_args(p: argparse.ArgumentParser) -> None:
    add_join_args(p)
    p.add_argument(
        "--stage", default="auto", help="stage index to serve, or auto: the stage with the least total throughput"
    )
    p.add_argument("--host", default="127.0.0.1", help="interface for gRPC and the DHT (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: any free port)")
    p.add_argument("--dht-port", type=int, default=0, help="DHT port (0: any free port)")
    p.add_argument("--announce-host", help="address other machines reach this peer at (behind NAT / in containers)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--announce-period", type=float, default=2.0, help="seconds between DHT record refreshes")
    p.add_argument("--record-ttl", type=float, default=8.0, help="seconds a DHT record lives without refresh")
    p.add_argument("--max-message-mb", type=int, default=256, help="largest request accepted, in MiB")
    p.add_argument("--checkpoint-dir", help="write (one peer per stage) and restore checkpoints of stages here")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument(
        "--averaging-timeout", type=float, default=30.0, help="longest a stage's gradient all-reduce may take"
    )
    p.add_argument("--no-benchmark-cache", action="store_true", help="re-measure throughput instead of using the cache")
    p.add_argument("--no-rebalance", action="store_true", help="never move to another stage")
    p.add_argument("--rebalance-period", type=float, default=15.0, help="seconds between rebalancing checks (+-30%%)")
    p.add_argument(
        "--rebalance-threshold",
        type=float,
        default=0.1,
        help="a move must raise the slowest stage by this fraction of the mean peer's throughput (default 0.1)",
    )
    p.add_argument("--move-cooldown", type=float, default=60.0, help="seconds after joining/moving before moving")
    p.add_argument("--fail-at-step", type=int, help="fault injection for tests: fail when the stage reaches this step")
    p.add_argument("--fail-mode", default="kill", choices=["kill", "stop", "exit"], help="how --fail-at-step fails")


def add_trainer_args(p: argparse.ArgumentParser) -> None:
    add_join_args(p)
    p.add_argument("--steps", type=int, default=60, help="train until the swarm has applied this many optimizer steps")
    p.add_argument("--trainer-index", type=int, default=0, help="this trainer's data shard")
    p.add_argument("--num-trainers", type=int, help="number of data shards (default: the run config's)")
    p.add_argument("--max-in-flight", type=int, default=8, help="microbatches in flight at once")
    p.add_argument("--max-retries", type=int, default=8, help="retries of one call before its microbatch is requeued")
    p.add_argument("--min-deadline", type=float, default=5.0, help="seconds every call gets at least")
    p.add_argument("--val-every", type=int, default=20, help="validation every N steps (trainer 0; 0 disables)")
    p.add_argument("--val-samples", type=int, default=64, help="validation samples")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--json-progress", action="store_true", help="print a parseable progress line per step on stdout")
    p.add_argument("--no-progress-bar", action="store_true")
    p.add_argument(
        "--sample-log",
        help="append every microbatch's step and sample indices to this JSON-lines file ({trainer}: the index)",
    )


def cmd_coordinator(args: argparse.Namespace) -> int:
    from swarm.training.config import RunConfig
    from swarm.coordinator import run_coordinator

    setup_logging("coordinator", args.log_level)
    if args.config_json:
        run = RunConfig.from_json(args.config_json)
    else:
        run = build_run_config(args, args.run_id or f"run-{uuid.uuid4().hex[:8]}", args.stages, args.num_trainers)
    _install_uvloop()
    return asyncio.run(
        run_coordinator(
            run, host=args.host, port=args.port, announce_host=args.announce_host, maddrs_file=args.maddrs_file
        )
    )


def cmd_peer(args: argparse.Namespace) -> int:
    from swarm.training.averaging import AveragingConfig
    from swarm.peer.daemon import PeerConfig, run_peer

    setup_logging("peer", args.log_level)
    try:
        cfg = PeerConfig(
            run_id=args.run_id,
            initial_peers=initial_peers(args),
            stage=args.stage,
            host=args.host,
            port=args.port,
            dht_port=args.dht_port,
            announce_host=args.announce_host,
            device=args.device,
            threads=args.threads,
            announce_period=args.announce_period,
            record_ttl=args.record_ttl,
            use_benchmark_cache=not args.no_benchmark_cache,
            max_message_mb=args.max_message_mb,
            rebalance=not args.no_rebalance,
            rebalance_period=args.rebalance_period,
            rebalance_threshold=args.rebalance_threshold,
            move_cooldown=args.move_cooldown,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            averaging=AveragingConfig(allreduce_timeout=args.averaging_timeout),
            fail_at_step=args.fail_at_step,
            fail_mode=args.fail_mode,
        )
    except ValueError as e:
        raise SystemExit(f"swarm peer: {e}") from None
    _install_uvloop()
    return asyncio.run(run_peer(cfg))


def cmd_trainer(args: argparse.Namespace) -> int:
    from swarm.trainer.loop import TrainerConfig, run_trainer

    setup_logging("trainer", args.log_level)
    cfg = TrainerConfig(
        run_id=args.run_id,
        initial_peers=initial_peers(args),
        steps=args.steps,
        trainer_index=args.trainer_index,
        num_trainers=args.num_trainers,
        max_in_flight=args.max_in_flight,
        max_retries=args.max_retries,
        min_deadline=args.min_deadline,
        val_every=args.val_every,
        val_samples=args.val_samples,
        threads=args.threads,
        host=args.host,
        json_progress=args.json_progress,
        progress_bar=not args.no_progress_bar,
        sample_log=args.sample_log,
    )
    _install_uvloop()
    asyncio.run(run_trainer(cfg))
    return 0


def cmd_local(args: argparse.Namespace) -> int:
    from swarm.local import LocalOptions, run_local

    setup_logging("local", args.log_level)
    layout = None
    if args.stage_layout:
        try:
            layout = [int(x) for x in args.stage_layout.split(",")]
        except ValueError:
            raise SystemExit(f"--stage-layout must be comma-separated peer counts, got {args.stage_layout!r}") from None
        if args.stages is None:
            args.stages = len(layout)
    stages = args.stages or 3
    run_id = args.run_id or f"local-{uuid.uuid4().hex[:8]}"
    run = build_run_config(args, run_id, stages, args.trainers, steps=args.steps)
    checkpoint_args = []
    if args.checkpoint_dir:
        checkpoint_args = ["--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every)]
    opts = LocalOptions(
        stages=stages,
        peers_per_stage=args.peers_per_stage,
        stage_layout=layout,
        trainers=args.trainers,
        steps=args.steps,
        run_id=run_id,
        log_dir=args.log_dir,
        threads=args.threads,
        run_args=["--config-json", run.to_json()],
        peer_args=checkpoint_args + list(args.peer_arg or []),
        trainer_args=list(args.trainer_arg or []),
    )
    try:
        opts.layout()
    except ValueError as e:
        raise SystemExit(f"swarm local: {e}") from None
    try:
        run_local(opts, as_json=args.json)
    except KeyboardInterrupt:
        print("\ninterrupted: every process of the local swarm was stopped", file=sys.stderr)
        return 130
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from swarm.status import collect_status, print_status

    setup_logging("status", args.log_level or "WARNING")
    status = asyncio.run(collect_status(args.run_id, initial_peers(args)))
    if args.json:
        print(json.dumps(status))
    else:
        print_status(status)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.export import export

    setup_logging("export", args.log_level)
    try:
        result = export(args.checkpoint_dir, args.out, args.step)
    except ValueError as e:
        raise SystemExit(f"swarm export: {e}") from None
    print(json.dumps(result))
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarm",
        description="SWARM-parallel training on a swarm of unreliable machines.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("coordinator", help="DHT bootstrap node; publishes the run config")
    p.add_argument("--run-id", help="run id (default: random)")
    p.add_argument("--stages", type=int, default=3, help="number of pipeline stages")
    p.add_argument("--num-trainers", type=int, default=1, help="trainers sharing the data (for sharding)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="DHT port (0: any free port)")
    p.add_argument("--announce-host", help="IP address other machines reach the coordinator at")
    p.add_argument("--maddrs-file", help="also write the multiaddrs to join with to this file (for scripts)")
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    add_run_args(p)
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("peer", help="the run-peer daemon: serves one pipeline stage")
    add_peer_args(p)
    p.set_defaults(func=cmd_peer)

    p = sub.add_parser("trainer", help="streams microbatches from its data shard through the stages")
    add_trainer_args(p)
    p.set_defaults(func=cmd_trainer)

    p = sub.add_parser("local", help="a whole swarm on this machine, every role its own process")
    p.add_argument("--stages", type=int, help="pipeline stages (default 3)")
    p.add_argument("--peers-per-stage", type=int, default=2)
    p.add_argument("--stage-layout", help="peers per stage, e.g. 3,1,1 (instead of --peers-per-stage)")
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last stdout line")
    p.add_argument("--run-id", help="run id (default: random)")
    p.add_argument("--log-dir", help="per-process logs (default runs/RUN_ID)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--checkpoint-dir", help="peers write and restore stage checkpoints here")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--peer-arg", action="append", help="extra argument for every peer (repeatable)")
    p.add_argument("--trainer-arg", action="append", help="extra argument for every trainer (repeatable)")
    add_run_args(p)
    p.set_defaults(func=cmd_local)

    p = sub.add_parser("status", help="the swarm now: stages, peers, throughput, bottleneck, recent events")
    add_join_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("export", help="merge stage checkpoints into one state_dict of the unsplit model")
    p.add_argument("--checkpoint-dir", required=True, help="the peers' --checkpoint-dir")
    p.add_argument("--out", required=True, help="output .pt file (a plain state_dict)")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the newest all stages have)")
    p.set_defaults(func=cmd_export)

    from swarm.sim.cli import add_sim_parser  # the simulator imports no torch or hivemind at all

    add_sim_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
