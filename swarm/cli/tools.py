"""`swarm local`, `swarm status`, `swarm export`: a whole swarm on this machine, and the tools that
look at one."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import uuid

from swarm.cli.common import add_join_args, initial_peers
from swarm.cli.run_options import add_run_options, apply_model_path, build_run_config
from swarm.core.errors import ConfigError
from swarm.core.log import setup_logging
from swarm.core.preflight import check_writable_dir
from swarm.core.settings import add_settings, default_of, from_args
from swarm.local import LocalOptions
from swarm.peer.config import PeerConfig


def add_local_parser(sub) -> None:
    p = sub.add_parser("local", help="a whole swarm on this machine, every role its own process")
    add_settings(p, LocalOptions, defaults={"stages": None})
    p.add_argument("--json", action="store_true", help="print one JSON summary as the last stdout line")
    p.add_argument("--checkpoint-dir", help="peers write and restore stage checkpoints here")
    every = default_of(PeerConfig, "checkpoint_every")
    p.add_argument("--checkpoint-every", type=int, default=every, help=f"steps between checkpoints (default {every})")
    p.add_argument("--peer-arg", action="append", default=[], help="extra argument for every peer (repeatable)")
    p.add_argument("--trainer-arg", action="append", default=[], help="extra argument for every trainer (repeatable)")
    add_run_options(p)
    p.set_defaults(func=cmd_local)


def cmd_local(args: argparse.Namespace) -> int:
    from swarm.local import run_local

    setup_logging("local", args.log_level)
    layout = args.stage_layout
    stages = args.stages or (len(layout) if layout else 3)
    run_id = args.run_id or f"local-{uuid.uuid4().hex[:8]}"
    run = build_run_config(args, run_id, stages, args.trainers, steps=args.steps)
    checkpoint_args = []
    if args.checkpoint_dir:
        checkpoint_args = ["--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every)]
    # the user asked for this model on their own command line: the local processes may import it
    allow = ["--allow-model", run.model["factory"]] if run.model.get("kind") == "custom" else []
    opts = from_args(
        LocalOptions,
        args,
        stages=stages,
        run_id=run_id,
        run_args=["--config-json", run.to_json()],
        peer_args=checkpoint_args + allow + args.peer_arg,
        trainer_args=allow + list(args.trainer_arg),
        env=model_path_env(args),
    )
    opts.layout()
    check_local(opts, run, args.checkpoint_dir)  # before any process starts
    signal.signal(signal.SIGTERM, _interrupt)  # stop everything (and remove a --netns lab) as on Ctrl-C
    try:
        run_local(opts, as_json=args.json)
    except KeyboardInterrupt:
        print("\ninterrupted: every process of the local swarm was stopped", file=sys.stderr)
        return 130
    return 0


def model_path_env(args: argparse.Namespace) -> dict[str, str]:
    """PYTHONPATH for the processes of a local swarm: --custom-model-path folders first."""
    paths = apply_model_path(args)
    if not paths:
        return {}
    return {"PYTHONPATH": os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def check_local(opts: LocalOptions, run, checkpoint_dir: str | None) -> None:
    """What `swarm local` can check before it starts a process: the model builds, the data loads and fits it,
    the folders it writes are writable (ConfigError with the fix)."""
    from swarm.training.preflight import check_run

    if opts.netns:
        from swarm.netlab import NetLabError, check_available, get_profile

        try:
            check_available()
            get_profile(opts.netns)
        except (NetLabError, ValueError) as e:
            raise ConfigError(f"--netns {opts.netns}: {e}") from None
    if checkpoint_dir:
        check_writable_dir(checkpoint_dir, "--checkpoint-dir")
    if opts.log_dir:
        check_writable_dir(opts.log_dir, "--log-dir")
    check_run(run)


def add_chaos_parser(sub) -> None:
    from swarm.chaos.config import ChaosOptions

    p = sub.add_parser(
        "chaos",
        help="train a local swarm through injected faults, then check every sample applied exactly once",
        description="A local swarm trains fault-free for --baseline-minutes (the throughput baseline), then "
        "through --minutes of faults (SIGKILL, SIGSTOP+SIGCONT and SIGTERM of peers, joins, a trainer killed "
        "and restarted, the coordinator killed; with --netns also a peer's network link cut for a while), "
        "then its ledger is checked against the trainers' logs. "
        "The last stdout line with --json: faults, steps, samples, lost, duplicated, misplaced, samples_per_s, "
        "fault_free_samples_per_s, throughput_ratio, val_loss, wall_s. Exit code 1 when the ledger is not exact "
        "or a process was left behind.",
    )
    add_settings(p, ChaosOptions)
    add_settings(p, LocalOptions, skip=("steps",), defaults={"stages": None, "trainers": 2})
    p.add_argument("--json", action="store_true", help="print one JSON result as the last stdout line")
    p.add_argument("--peer-arg", action="append", default=[], help="extra argument for every peer (repeatable)")
    add_run_options(p)
    p.set_defaults(func=cmd_chaos)


def cmd_chaos(args: argparse.Namespace) -> int:
    from swarm.chaos.config import ChaosOptions
    from swarm.chaos.runner import print_result, run_chaos

    setup_logging("chaos", args.log_level or "WARNING")
    try:
        chaos = from_args(ChaosOptions, args)
        chaos.resolve_kinds(bool(args.netns))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    layout = args.stage_layout
    stages = args.stages or (len(layout) if layout else 3)
    run_id = args.run_id or f"chaos-{uuid.uuid4().hex[:8]}"
    run = build_run_config(args, run_id, stages, args.trainers)
    local = from_args(
        LocalOptions, args, stages=stages, run_id=run_id, run_args=["--config-json", run.to_json()],
        peer_args=list(args.peer_arg),
    )  # fmt: skip
    signal.signal(signal.SIGTERM, _interrupt)  # stop everything (and remove a --netns lab) as on Ctrl-C
    try:
        result = run_chaos(chaos, local, run)
    except KeyboardInterrupt:
        print("\ninterrupted: every process of the chaos run was stopped; no ledger check", file=sys.stderr)
        return 130
    print_result(result, args.json)
    return 0 if result["ledger_ok"] and result["leftover_processes"] == 0 else 1


def add_dashboard_parser(sub) -> None:
    from swarm.dashboard.config import DashboardConfig

    p = sub.add_parser(
        "dashboard",
        help="the swarm and its training, live in a browser (read-only), with an API and Prometheus metrics",
        description="Serves one page (stages, peers, loss and throughput plots, events), GET /api/v1/state (JSON), "
        "GET /metrics (Prometheus) and GET /healthz. It joins the DHT as a client and polls the peers' Info at "
        "most once per refresh each; it prints 'dashboard: URL' once it serves.",
    )
    add_join_args(p)
    add_settings(p, DashboardConfig)
    p.set_defaults(func=cmd_dashboard)


def cmd_dashboard(args: argparse.Namespace) -> int:
    from swarm.cluster.authority import join_run
    from swarm.dashboard.collector import LiveSource
    from swarm.dashboard.live import CONFIG_TIMEOUT_S, DashboardConfig
    from swarm.dashboard.server import serve_forever
    from swarm.dht.node import SwarmDHT

    setup_logging("dashboard", args.log_level or "WARNING")
    cfg = from_args(DashboardConfig, args)
    dht = SwarmDHT(args.run_id, initial_peers(args), client_mode=True)  # on the main thread: it outlives the DHT
    keeper = None
    try:
        signed, keeper = join_run(dht, CONFIG_TIMEOUT_S, args.run_key, args.invite, "observer")
        source = LiveSource(dht, signed.run)
        if keeper is not None:
            source.clients.credentials = keeper.credentials
        ready = lambda url: print(f"dashboard: {url}", flush=True)  # noqa: E731
        asyncio.run(serve_forever(source, cfg.host, cfg.port, cfg.refresh_s, on_ready=ready))
    except KeyboardInterrupt:
        pass
    finally:
        if keeper is not None:
            keeper.stop()
        dht.shutdown()
    return 0


def add_status_parser(sub) -> None:
    p = sub.add_parser("status", help="the swarm now: stages, peers, throughput, bottleneck, recent events")
    add_join_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from swarm.status import collect_status, print_status

    setup_logging("status", args.log_level or "WARNING")
    status = asyncio.run(collect_status(args.run_id, initial_peers(args), run_key=args.run_key, invite=args.invite))
    if args.json:
        print(json.dumps(status))
    else:
        print_status(status)
    return 0


def add_ledger_parser(sub) -> None:
    p = sub.add_parser("ledger", help="check that every sample entered every stage exactly once")
    add_join_args(p)
    p.add_argument(
        "--sample-logs",
        nargs="+",
        metavar="GLOB",
        help="the trainers' --sample-log files (default: check against the run's plan, without sample indices)",
    )
    p.add_argument("--ledger-dir", help="also read the peers' --ledger-dir files (dead peers' ledgers too)")
    p.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    p.set_defaults(func=cmd_ledger)


def cmd_ledger(args: argparse.Namespace) -> int:
    from swarm.ledger import check_run, collect, read_ledger_dir, read_sample_logs
    from swarm.policy.ledger import format_report

    setup_logging("ledger", args.log_level or "WARNING")
    run, entries = asyncio.run(collect(args.run_id, initial_peers(args), args.run_key, args.invite))
    if args.ledger_dir:
        entries += read_ledger_dir(args.ledger_dir)
    assignments = read_sample_logs(args.sample_logs) if args.sample_logs else None
    report = check_run(run, entries, assignments)
    if args.json:
        print(json.dumps({"through_step": report.through_step, "checked": report.checked, **report.counts()}))
    else:
        print(format_report(report))
    if report.checked == 0:
        print("swarm ledger: nothing was checked: no update of every stage was found", file=sys.stderr)
    return 0 if report.passed else 1


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="merge stage checkpoints into one state_dict of the unsplit model")
    p.add_argument("--checkpoint-dir", required=True, help="the peers' --checkpoint-dir")
    p.add_argument("--out", required=True, help="output .pt file (a plain state_dict)")
    p.add_argument("--step", type=int, help="checkpoint step to export (default: the newest all stages have)")
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from swarm.export import export

    setup_logging("export", args.log_level)
    try:
        result = export(args.checkpoint_dir, args.out, args.step)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    print(json.dumps(result))
    return 0
