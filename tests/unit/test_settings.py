"""One source of truth for settings: every command line is generated from (or checked against) the
config dataclasses, so a default written in one place is the default everywhere."""

import dataclasses

from swarm.cli import make_parser
from swarm.cli.run_options import build_run_config
from swarm.coordinator import CoordinatorConfig
from swarm.core.settings import LIVENESS_WINDOW_S, from_args
from swarm.local import LocalOptions
from swarm.peer.config import PeerConfig
from swarm.sim.cli import configs_from_args
from swarm.sim.config import SimConfig
from swarm.trainer.config import TrainerConfig
from swarm.training.averaging import AveragingConfig
from swarm.training.config import RunConfig

PEERS = ["--run-id", "r1", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/X"]


def parse(*argv: str):
    return make_parser().parse_args(list(argv))


def test_peer_options_default_to_peer_config():
    args = parse("peer", *PEERS)
    cfg = from_args(PeerConfig, args, initial_peers=args.initial_peers, averaging=from_args(AveragingConfig, args))
    assert cfg == PeerConfig(run_id="r1", initial_peers=args.initial_peers)


def test_peer_options_set_fields_with_units_dropped_from_flags():
    args = parse("peer", *PEERS, "--drain-timeout", "3", "--no-rebalance", "--averaging-timeout", "7", "--stage", "1")
    cfg = from_args(PeerConfig, args, averaging=from_args(AveragingConfig, args))
    assert cfg.drain_timeout_s == 3.0 and cfg.rebalance is False and cfg.stage == "1"
    assert cfg.averaging.allreduce_timeout_s == 7.0


def test_trainer_options_default_to_trainer_config():
    args = parse("trainer", *PEERS)
    assert from_args(TrainerConfig, args) == TrainerConfig(run_id="r1")
    assert from_args(TrainerConfig, parse("trainer", *PEERS, "--no-progress-bar")).progress_bar is False


def test_coordinator_and_run_options_default_to_the_dataclasses():
    args = parse("coordinator")
    assert from_args(CoordinatorConfig, args) == CoordinatorConfig()
    run = build_run_config(args, "r1", args.stages, args.num_trainers)
    assert run == RunConfig(run_id="r1")


def test_run_options_override_the_defaults():
    args = parse("coordinator", "--lr", "0.01", "--sync", "exact", "--dataset", "synthetic", "--no-predict-params")
    run = build_run_config(args, "r1", 3, 1)
    assert run.optim.lr == 0.01 and run.sync == "exact" and run.data.kind == "synthetic"
    assert run.predict_params is False
    assert run.global_batch == RunConfig(run_id="r1").global_batch


def test_local_options_default_to_local_options():
    args = parse("local")
    opts = from_args(LocalOptions, args, stages=3)
    assert opts == LocalOptions(python=opts.python)
    assert parse("local", "--stage-layout", "3,1,1").stage_layout == [3, 1, 1]


def test_sim_options_default_to_sim_config():
    args = parse("sim")
    (first, *_) = configs_from_args(args)
    varied = {"policy", "rebalance"}  # one run per policy and setting
    for field in dataclasses.fields(SimConfig):
        if field.name not in varied:
            assert getattr(first, field.name) == getattr(SimConfig(), field.name), field.name


def test_one_liveness_window():
    assert SimConfig().dead_after == LIVENESS_WINDOW_S
