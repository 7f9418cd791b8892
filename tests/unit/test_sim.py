"""The swarm simulator (swarm sim): deterministic, drives the real wiring and rebalancing code, loses no
microbatch to preemptions, and shows what rebalancing is for."""

import argparse
import json

import pytest

from swarm.policy import wiring
from swarm.sim.cli import add_sim_parser
from swarm.sim.config import SimConfig
from swarm.sim.engine import Simulator, run_sim

SMALL = dict(peers=24, stages=3, sim_seconds=1800.0, hops_per_peer=300.0)


def small(**kw) -> SimConfig:
    return SimConfig(**{**SMALL, **kw})


def figures(cfg: SimConfig) -> dict:
    """A run's results, less its timings (which vary from machine to machine)."""
    r = run_sim(cfg)
    d = r.summary()
    del d["wall_s"], d["cpu_s"]
    return {**d, "series": r.series}


def test_same_seed_same_run_and_another_seed_differs():
    cfg = small(preemption_rate=2.0)
    a, b = figures(cfg), figures(cfg)
    assert a["preemptions"] > 0
    assert a == b
    assert figures(small(preemption_rate=2.0, seed=1)) != a


def test_ours_reaches_the_ideal_on_a_balanced_swarm_without_preemptions():
    r = run_sim(small(policy="ours", rebalance=False, initial="balanced", preemption_rate=0.0))
    assert r.preemptions == 0 and r.retries == 0 and r.wasted_work_fraction == 0.0
    assert r.placement_fraction_of_ideal > 0.99
    assert r.throughput_fraction_of_ideal > 0.9
    assert r.microbatches_completed > 100


def test_ours_beats_uniform_routing_on_heterogeneous_peers():
    kw = dict(rebalance=False, initial="balanced", preemption_rate=0.0, throughput_sigma=0.8)
    ours, uniform = run_sim(small(policy="ours", **kw)), run_sim(small(policy="uniform", **kw))
    assert ours.throughput > 1.3 * uniform.throughput


def test_rebalancing_repairs_a_skewed_start():
    kw = dict(initial="skewed", preemption_rate=0.0)  # one peer on stages 1 and 2, the rest on stage 0
    on, off = run_sim(small(rebalance=True, **kw)), run_sim(small(rebalance=False, **kw))
    assert off.moves == 0 and off.throughput_fraction_of_ideal < 0.3
    assert on.moves >= 5
    assert on.placement_fraction_of_ideal > 0.8
    assert on.throughput > 2.5 * off.throughput


def test_joiners_go_to_the_weakest_stage_with_rebalancing():
    kw = dict(initial="skewed", preemption_rate=0.0, join_rate=6.0, rebalance_period=1e9)  # joins only, no moves
    on, off = run_sim(small(rebalance=True, **kw)), run_sim(small(rebalance=False, **kw))
    assert on.joins == off.joins > 40
    assert on.moves == 0
    assert on.placement_fraction_of_ideal > off.placement_fraction_of_ideal + 0.1
    assert on.throughput > off.throughput


def test_preempted_work_is_wasted_and_retried_never_lost():
    sim = Simulator(small(preemption_rate=4.0, join_rate=4.0))
    r = sim.run()
    assert r.preemptions > 20
    assert r.retries > 0  # the hops that were on the dead peers went elsewhere
    assert 0.0 < r.wasted_work_fraction < 0.1
    assert r.lost_microbatches == 0  # every microbatch is still queued, computing, in transit or being retried
    assert r.microbatches_completed > 100


def test_a_stage_left_without_peers_waits_for_a_joiner():
    r = run_sim(SimConfig(peers=2, stages=2, sim_seconds=3600.0, preemption_rate=6.0, join_rate=6.0, seed=3))
    assert r.preemptions > 5
    assert r.lost_microbatches == 0
    assert r.microbatches_completed > 0


def test_ours_runs_the_real_wiring_class(monkeypatch):
    calls = {"choose": 0, "on_failure": 0}
    choose, on_failure = wiring.Wiring.choose, wiring.Wiring.on_failure

    def counting_choose(self, *a, **kw):
        calls["choose"] += 1
        return choose(self, *a, **kw)

    def counting_on_failure(self, *a, **kw):
        calls["on_failure"] += 1
        return on_failure(self, *a, **kw)

    monkeypatch.setattr(wiring.Wiring, "choose", counting_choose)
    monkeypatch.setattr(wiring.Wiring, "on_failure", counting_on_failure)
    r = run_sim(small(policy="ours", preemption_rate=4.0))
    assert calls["choose"] >= r.hops
    assert calls["on_failure"] == r.retries > 0
    calls["choose"] = 0
    run_sim(small(policy="uniform", preemption_rate=0.0))
    assert calls["choose"] == 0


def test_config_rejects_impossible_swarms():
    with pytest.raises(ValueError):
        SimConfig(peers=2, stages=3).resolved()
    with pytest.raises(ValueError):
        SimConfig(policy="greedy").resolved()


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="swarm")
    add_sim_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["sim", *argv])
    return args.func(args)


def test_cli_json_has_the_headline_and_every_run(tmp_path, capsys):
    argv = ["--peers", "16", "--stages", "2", "--sim-seconds", "900", "--hops-per-peer", "100"]
    rc = _run_cli([*argv, "--json", "--no-plots", "--jobs", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("peers", "stages", "throughput_fraction_of_ideal", "moves", "sim_seconds", "wall_s", "runs"):
        assert key in doc
    assert (doc["peers"], doc["stages"], doc["sim_seconds"]) == (16, 2, 900.0)
    assert (doc["policy"], doc["rebalance"]) == ("ours", True)
    runs = {(r["policy"], r["rebalance"]) for r in doc["runs"]}
    assert runs == {(p, on) for p in ("ours", "uniform", "weighted") for on in (True, False)}
    for r in doc["runs"]:
        assert {"throughput_fraction_of_ideal", "moves", "sim_seconds", "wall_s"} <= r.keys()
    assert (tmp_path / "results.json").exists()


def test_cli_table_and_plots(tmp_path, capsys):
    argv = ["--peers", "8", "--stages", "2", "--sim-seconds", "600", "--hops-per-peer", "100", "--policy", "ours"]
    assert _run_cli([*argv, "--rebalance", "on", "--jobs", "1", "--out-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "of ideal" in out and "ours" in out
    assert (tmp_path / "throughput_over_time.png").stat().st_size > 1000
    assert (tmp_path / "summary.png").stat().st_size > 1000


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    assert _run_cli(["--peers", "2", "--stages", "4", "--out-dir", str(tmp_path)]) == 2
    assert "at least" in capsys.readouterr().err
