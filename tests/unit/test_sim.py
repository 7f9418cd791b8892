"""The swarm simulator (swarm sim): deterministic, drives the real wiring, pacing and rebalancing code,
loses no microbatch to preemptions, shows what rebalancing is for, and models what costs time: the
step barrier, the all-reduce, Info polls and DHT reads."""

import argparse
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.policy import wiring
from swarm.policy.polling import WATCH_MAX_MATES, WATCH_WAIT_S
from swarm.policy.wiring import Wiring
from swarm.sim import steps
from swarm.sim.cli import add_sim_parser
from swarm.sim.config import SimConfig
from swarm.sim.engine import Simulator, run_sim
from swarm.sim.overheads import dht_load, poll_load, trainer_load
from swarm.sim.routing import Router, StageView, sim_load
from swarm.training.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(peers=24, stages=3, sim_seconds=1800.0, hops_per_peer=300.0)
LARGE_BATCH = 250_000.0  # >= 4x the samples in flight of SMALL: one simulated step per optimizer step


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


def test_ours_checks_every_pick_against_the_real_wiring_class(monkeypatch):
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
    # check_routing: every fast pick is compared with Wiring.choose (a mismatch raises)
    r = run_sim(small(policy="ours", preemption_rate=4.0, trainers=3, check_routing=True))
    assert calls["choose"] >= r.hops
    assert calls["on_failure"] == r.retries > 0
    calls["choose"] = 0
    run_sim(small(policy="uniform", preemption_rate=0.0))
    assert calls["choose"] == 0


def _random_view(rng: random.Random, now: float) -> StageView:
    view = StageView(0)
    for i in range(rng.randint(1, 30)):
        # few distinct values, so that exact ties and near-ties happen often
        load = sim_load(f"p{i:03d}", rng.choice([50.0, 100.0, 100.0 * (1 + 1e-10), 200.0, 0.0]))
        load.reported_queue = rng.choice([0.0, 0.0, 100.0, 300.0])
        load.in_flight = rng.choice([0.0, 50.0, 100.0, rng.uniform(0, 400)])
        load.online = rng.random() > 0.1
        load.banned_until = now + 1 if rng.random() < 0.1 else 0.0
        view.add(load)
    if rng.random() < 0.3 and view.loads:  # a peer left the view: its slot is free, and may be reused
        view.remove(rng.choice(view.loads))
    return view


def test_fast_routing_picks_what_wiring_choose_picks():
    rng, now, fallbacks = random.Random(7), 100.0, 0
    for trial in range(400):
        view = _random_view(rng, now)
        work = rng.choice([0.0, 50.0, 100.0, 133.3])
        ids = [p.peer_id for p in view.loads]
        exclude = frozenset(rng.sample(ids, min(len(ids), rng.randint(0, 2))))
        router = Router("ours", Wiring(random.Random(trial)), random.Random(0), [[view]])
        for load in view.loads:
            if load.banned_until > 0:
                router.banned(load)  # as the simulator does after every Wiring.on_failure
        reference = Wiring(random.Random(trial))
        expected = reference.choose(list(view.loads), work, now, exclude)
        if expected is not None:
            expected.assigned -= 1
        assert router.pick(0, 0, work, now, exclude) is expected
        assert router.wiring.rng.getstate() == reference.rng.getstate()  # ties drew the same numbers
        fallbacks = router.fallbacks + fallbacks
    assert 0 < fallbacks < 300  # the ties went to Wiring.choose, the rest did not


def test_config_rejects_impossible_swarms():
    with pytest.raises(ValueError):
        SimConfig(peers=2, stages=3).resolved()
    with pytest.raises(ValueError):
        SimConfig(policy="greedy").resolved()
    with pytest.raises(ValueError, match="dht-quiet-factor"):  # below 1 the views would read faster when quiet
        SimConfig(dht_quiet_factor=0.5).resolved()


def _run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="swarm")
    add_sim_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["sim", *argv])
    return args.func(args)


def test_cli_json_has_the_headline_and_every_run(tmp_path, capsys):
    argv = ["--peers", "16", "--stages", "2", "--sim-seconds", "900", "--hops-per-peer", "100"]
    argv += ["--policy", "all", "--rebalance", "both"]
    rc = _run_cli([*argv, "--json", "--no-plots", "--jobs", "1", "--out-dir", str(tmp_path)])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = ("peers", "stages", "throughput_fraction_of_ideal", "moves", "sim_seconds", "wall_s", "runs", "steps")
    for key in (*keys, "fraction_of_ideal_with_overheads", "update_s", "allreduce_s", "overheads", "cpu_s"):
        assert key in doc
    assert doc["overheads"]["info_cpu_share"] > 0
    assert (doc["peers"], doc["stages"], doc["sim_seconds"]) == (16, 2, 900.0)
    assert (doc["policy"], doc["rebalance"]) == ("ours", True)
    runs = {(r["policy"], r["rebalance"]) for r in doc["runs"]}
    assert runs == {(p, on) for p in ("ours", "uniform", "weighted") for on in (True, False)}
    for r in doc["runs"]:
        assert {"throughput_fraction_of_ideal", "moves", "sim_seconds", "wall_s", "steps", "replays"} <= r.keys()
    assert (tmp_path / "results.json").exists()


def test_cli_runs_the_headline_configuration_by_default(tmp_path, capsys):
    argv = ["--peers", "16", "--stages", "2", "--sim-seconds", "600", "--hops-per-peer", "100", "--no-plots"]
    assert _run_cli([*argv, "--json", "--out-dir", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["policy"], r["rebalance"]) for r in doc["runs"]] == [("ours", True)]


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


# ---- steps: the barrier, the all-reduce, exact against async ----


class Recording(Simulator):
    """Checks, as the run goes, that no stage holds more than the global batch for a step, and records
    how far apart the stages' steps get."""

    def __init__(self, cfg: SimConfig) -> None:
        self.most_held, self.spread = 0.0, 0
        super().__init__(cfg)

    def _contribute(self, peer, trainer, tag, n):
        super()._contribute(peer, trainer, tag, n)
        self.most_held = max(self.most_held, self.counts[peer.stage].get(tag, 0.0))

    def _update(self, event):
        super()._update(event)
        self.spread = max(self.spread, max(self.stage_step) - min(self.stage_step))


def test_a_stage_never_holds_more_than_the_global_batch_nor_runs_ahead_of_the_slowest():
    for sync, bound in (("async", 2), ("exact", 1)):  # async: one step of staleness, plus the one pending
        sim = Recording(small(global_batch=LARGE_BATCH, sync=sync, preemption_rate=2.0))
        r = sim.run()
        assert r.steps_per_sim_step == 1 and r.steps >= 3
        assert sim.most_held <= LARGE_BATCH  # the stage waits: it never takes more than the step's batch
        assert 1 <= sim.spread <= bound
        assert r.batch_violations == 0 and r.lost_microbatches == 0


def test_exact_mode_is_slower_than_async():
    kw = dict(global_batch=LARGE_BATCH, preemption_rate=0.0, initial="balanced")
    fast, exact = run_sim(small(sync="async", **kw)), run_sim(small(sync="exact", **kw))
    assert exact.throughput < 0.97 * fast.throughput
    assert exact.pacing_idle_fraction > fast.pacing_idle_fraction + 0.02  # trainers wait at every step


def test_a_batch_small_next_to_the_pipeline_holds_the_trainers_back(monkeypatch):
    monkeypatch.setattr(steps, "BATCH_PER_IN_FLIGHT", 1e-9)  # no coarse steps: pace by the batch itself
    r = run_sim(small(global_batch=LARGE_BATCH / 8, preemption_rate=0.0))
    assert r.steps_per_sim_step == 1
    assert r.pacing_idle_fraction > 0.2
    assert r.throughput < 0.8 * run_sim(small(preemption_rate=0.0)).throughput


class FakePeer:
    def __init__(self, bw: float, lat: float = 0.03) -> None:
        self.bw, self.lat = bw, lat


def test_allreduce_time_grows_with_parameter_bytes_and_falls_with_bandwidth():
    def t(n, grad, bw):
        return steps.allreduce_seconds([FakePeer(bw) for _ in range(n)], grad, lambda p: p.bw)

    assert t(1, 1e8, 1e8) == 0.0  # alone: nothing to average
    assert t(8, 2e8, 1e8) > t(8, 1e8, 1e8) > t(8, 1e8, 4e8)
    assert t(8, 1e8, 1e8) == pytest.approx(2 * 1e8 * 7 / 8 / 1e8 + 2 * 2 * 0.03)
    slow = steps.allreduce_seconds([FakePeer(1e8), FakePeer(1e6)], 1e8, lambda p: p.bw)
    assert slow == pytest.approx(1e8 / 1e6 + 0.12)  # the slowest link sets the pace
    # in a run: rounds take longer with more parameters and slower links
    small_params, big_params = run_sim(small(stage_param_mb=10.0)), run_sim(small(stage_param_mb=400.0))
    slow_links = run_sim(small(stage_param_mb=400.0, bandwidth_median_mbps=100.0))
    assert small_params.allreduce_s < big_params.allreduce_s < slow_links.allreduce_s
    assert small_params.update_s < big_params.update_s


def test_rounds_slower_than_the_steps_hold_the_swarm_back():
    fine, jammed = run_sim(small()), run_sim(small(stage_param_mb=20_000.0))
    assert jammed.update_s > 10 * fine.update_s
    assert jammed.throughput < 0.5 * fine.throughput  # trainers may not run further ahead of the rounds


def test_preempted_gradients_are_replayed_and_every_update_holds_exactly_its_batch():
    failed = 0
    for batch in (None, LARGE_BATCH):  # simulated steps of 4 optimizer steps, and of one
        r = run_sim(small(preemption_rate=4.0, join_rate=4.0, global_batch=batch))
        assert r.replays > 0  # what the dead peers held for updates not applied yet
        assert r.batch_violations == 0 and r.lost_microbatches == 0
        assert r.steps >= 2
        failed += r.failed_rounds
    assert failed > 0  # members died during their stage's all-reduce


def test_step_defaults_are_the_trainers():
    run = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert SimConfig().max_staleness == run["max_staleness"]
    assert SimConfig().ahead_after == run["ahead_after"]


# ---- Info polls and DHT reads ----


def test_polling_cost_grows_with_trainers_and_peers_and_the_budget_caps_it():
    cfg = SimConfig(polling="fixed")
    base = poll_load(100, 1, cfg)
    assert base.answers_s == pytest.approx((99 + 1) / cfg.info_period)
    assert poll_load(100, 10, cfg).answers_s > base.answers_s  # more trainers
    assert poll_load(1000, 1, cfg).cpu_share > 5 * base.cpu_share  # more stage-mates
    assert trainer_load(10_000, cfg, base)[0] == pytest.approx(10 * trainer_load(1000, cfg, base)[0])
    budget = dataclasses.replace(cfg, polling="budget")
    capped = poll_load(1000, 100, budget)
    assert capped.answers_s == pytest.approx(cfg.info_budget)
    assert capped.period_s > cfg.info_period  # the price: staler views
    assert capped.cpu_share < poll_load(1000, 100, cfg).cpu_share / 10
    dht, dht_budget = dht_load(10_000, 1, 16, cfg), dht_load(10_000, 1, 16, budget)
    assert dht_budget.replica_link_bps <= budget.dht_budget_mbps * 1e6 / 8 * (1 + 1e-9) < dht.replica_link_bps
    assert dht_budget.period_s > dht.period_s


def test_small_stages_watch_their_mates_and_large_ones_poll_them():
    """swarm.cluster.watch: a peer with at most WATCH_MAX_MATES mates holds a long poll on each, answered
    per change of the mate's count and once per WATCH_WAIT_S; beyond that it polls at the budget."""
    cfg = SimConfig()
    small = poll_load(4, 2, cfg, mate_changes_s=2.0)
    assert small.watched and small.polls_s == pytest.approx(3 * (1 / WATCH_WAIT_S + 2.0))
    assert small.answers_s == pytest.approx(2 / cfg.info_period + small.polls_s)  # the trainers poll as before
    large = poll_load(WATCH_MAX_MATES + 2, 2, cfg, mate_changes_s=2.0)
    assert not large.watched and large.polls_s == pytest.approx((WATCH_MAX_MATES + 1) / large.period_s)
    assert not poll_load(4, 2, dataclasses.replace(cfg, polling="fixed")).watched  # the code before both


def test_polling_slows_a_crowded_stage_and_the_budget_restores_it():
    # the code's polls before 2026-12-05: every 0.1 s (now 0.25 s at least)
    kw = dict(peers=400, stages=2, sim_seconds=900.0, hops_per_peer=30.0, preemption_rate=0.0, info_period=0.1)
    fixed, budget = run_sim(SimConfig(polling="fixed", **kw)), run_sim(SimConfig(polling="budget", **kw))
    assert fixed.overheads["info_cpu_share"] > 0.5  # 200 mates polling each other 10 times a second
    assert budget.overheads["info_cpu_share"] < 0.1
    assert budget.throughput > 2 * fixed.throughput
    assert budget.overheads["dht_period_s"] >= fixed.overheads["dht_period_s"]


def test_views_read_the_dht_less_while_the_swarm_is_quiet_and_at_the_base_period_through_churn():
    """swarm.cluster.dht_reads in the model: three reads without news stretch a view's period (x3);
    news (joins, preemptions, moves) brings it back. --dht-quiet-factor 1 is the code before."""
    kw = dict(peers=24, stages=3, sim_seconds=1800.0, hops_per_peer=100.0, rebalance=False, initial="balanced")
    quiet = run_sim(SimConfig(preemption_rate=0.0, **kw)).overheads
    before = run_sim(SimConfig(preemption_rate=0.0, dht_quiet_factor=1.0, **kw)).overheads
    churn = run_sim(SimConfig(preemption_rate=30.0, **kw)).overheads  # 0.2 preemptions and joins a second
    assert before["dht_quiet_share"] == 0.0 and before["dht_mean_read_s"] == pytest.approx(before["dht_period_s"])
    assert quiet["dht_quiet_share"] > 0.9 and quiet["dht_mean_read_s"] > 2.5 * quiet["dht_period_s"]
    assert quiet["dht_replica_reads_s"] < 0.4 * before["dht_replica_reads_s"]
    assert churn["dht_quiet_share"] < 0.2 and churn["dht_mean_read_s"] < 1.1 * churn["dht_period_s"]


def test_a_peer_joining_a_stage_the_trainers_wait_for_is_found_at_once_whatever_the_dht_period():
    """A trainer with no usable peer in a stage asks its view for a DHT read (after MIN_GAP_S at most):
    with one peer per stage every preemption empties one, and a 5-minute DHT period costs little."""
    kw = dict(peers=2, stages=2, sim_seconds=3600.0, preemption_rate=6.0, join_rate=6.0, seed=3)
    fast, slow = run_sim(SimConfig(dht_period=2.0, **kw)), run_sim(SimConfig(dht_period=300.0, **kw))
    assert fast.preemptions == slow.preemptions > 5
    assert slow.throughput > 0.8 * fast.throughput  # 0.38x when the joiner waited for the next periodic read


def test_bench_quick_prints_its_figures():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_sim.py"), "--quick", "--polling", "budget"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=True,
    ).stdout  # fmt: skip
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["quick"] is True
    for run in doc["runs"]:
        assert run["wall_s"] > 0 and run["cpu_s"] > 0
        assert 0 < run["throughput_fraction_of_ideal"] <= 1.5
        assert run["steps"] > 0
    assert [r["polling"] for r in doc["runs"]] == ["budget"]
    assert doc["polling_costs"]
