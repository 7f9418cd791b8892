"""`swarm coordinator`, `swarm peer`, `swarm trainer`: the processes of a swarm. Their options are
generated from the roles' config dataclasses (swarm.core.settings)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import uuid

from swarm.cli.common import add_join_args, initial_peers, install_uvloop
from swarm.cli.run_options import add_model_path_arg, add_run_options, apply_model_path, build_run_config
from swarm.core.debug import add_debug_args, fault_plan_from_args, lie_plan_from_args
from swarm.core.errors import ConfigError
from swarm.core.log import setup_logging
from swarm.core.preflight import check_port_free, check_reachable, check_writable_dir, parse_maddrs
from swarm.core.settings import add_settings, default_of, from_args


def add_coordinator_parser(sub) -> None:
    from swarm.coordinator import CoordinatorConfig
    from swarm.training.config import RunConfig

    p = sub.add_parser("coordinator", help="DHT bootstrap node; publishes the run config")
    p.add_argument("--run-id", help="run id (default: random)")
    p.add_argument("--stages", type=int, default=default_of(RunConfig, "num_stages"), help="pipeline stages")
    p.add_argument(
        "--num-trainers", type=int, default=default_of(RunConfig, "num_trainers"), help="trainers sharing the data"
    )
    add_settings(p, CoordinatorConfig)
    p.add_argument("--config-json", help=argparse.SUPPRESS)
    add_run_options(p)
    p.set_defaults(func=cmd_coordinator)


def cmd_coordinator(args: argparse.Namespace) -> int:
    from swarm.coordinator import CoordinatorConfig, run_coordinator
    from swarm.training.config import RunConfig

    setup_logging("coordinator", args.log_level)
    if args.config_json:
        run = RunConfig.from_json(args.config_json)
    else:
        run = build_run_config(args, args.run_id or f"run-{uuid.uuid4().hex[:8]}", args.stages, args.num_trainers)
    cfg = from_args(CoordinatorConfig, args)
    if cfg.private != run.private:  # the flag decides; a --config-json's own field is overridden
        run = dataclasses.replace(run, private=cfg.private, tls_ca="")  # the coordinator sets tls_ca
    check_port_free(cfg.host, cfg.port, "--port")
    if cfg.maddrs_file:
        check_writable_dir(os.path.dirname(os.path.abspath(cfg.maddrs_file)), "--maddrs-file's folder")
    if cfg.initial_peers:
        check_reachable(parse_maddrs(cfg.initial_peers))
    install_uvloop()
    return asyncio.run(run_coordinator(run, cfg))


def add_peer_parser(sub) -> None:
    from swarm.peer.config import PeerConfig
    from swarm.training.averaging import AveragingConfig

    p = sub.add_parser("peer", help="the run-peer daemon: serves one pipeline stage")
    add_join_args(p)
    add_model_path_arg(p)
    add_settings(p, PeerConfig, skip=("run_id",))
    p.add_argument("--public-ip", dest="announce_host", metavar="IP", help="the same as --announce-host")
    add_settings(p, AveragingConfig)
    add_debug_args(p)
    p.set_defaults(func=cmd_peer)


def cmd_peer(args: argparse.Namespace) -> int:
    from swarm.peer.config import PeerConfig
    from swarm.peer.daemon import run_peer
    from swarm.peer.preflight import check_settings
    from swarm.training.averaging import AveragingConfig

    setup_logging("peer", args.log_level)
    apply_model_path(args)
    try:
        averaging = from_args(AveragingConfig, args)
        joins = {"initial_peers": initial_peers(args), "run_key": args.run_key, "invite": args.invite}
        cfg = from_args(PeerConfig, args, averaging=averaging, **joins)
        faults = fault_plan_from_args(args)
        lie = lie_plan_from_args(args)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    install_uvloop()
    if cfg.check:
        from swarm.peer.check import run_check

        return run_check(cfg)
    check_settings(cfg)  # before anything starts
    return asyncio.run(run_peer(cfg, faults, args.profile_dir, lie))


def add_trainer_parser(sub) -> None:
    from swarm.trainer.config import TrainerConfig

    p = sub.add_parser("trainer", help="streams microbatches from its data shard through the stages")
    add_join_args(p)
    add_model_path_arg(p)
    add_settings(p, TrainerConfig, skip=("run_id",))
    p.set_defaults(func=cmd_trainer)


def cmd_trainer(args: argparse.Namespace) -> int:
    from swarm.trainer.config import TrainerConfig
    from swarm.trainer.loop import run_trainer

    setup_logging("trainer", args.log_level)
    apply_model_path(args)
    cfg = from_args(TrainerConfig, args, initial_peers=initial_peers(args), run_key=args.run_key, invite=args.invite)
    if cfg.sample_log:
        check_writable_dir(os.path.dirname(os.path.abspath(cfg.sample_log)), "--sample-log's folder")
    check_reachable(parse_maddrs(cfg.initial_peers))
    install_uvloop()
    asyncio.run(run_trainer(cfg))
    return 0
