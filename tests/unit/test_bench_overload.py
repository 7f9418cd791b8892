"""scripts/bench_overload.py turns a `swarm local --json` summary into the overload figures: what each
stage accumulated as new contributions, apart from duplicates and spot checks, and how much of the
work was redone."""

from scripts.bench_overload import GLOBAL_BATCH, figures


def test_figures_separate_new_contributions_from_waste():
    summary = {
        "steps": 10, "samples_per_s": 12.5, "peer_failures": 1, "retries": 3, "replays": 2,
        "microbatches_started": 100, "val_loss": None,
        "peers": [
            {"stage": 0, "samples_processed": 200, "duplicate_samples": 20, "check_samples": 10},
            {"stage": 0, "samples_processed": 150, "duplicate_samples": 0, "check_samples": 0},
            {"stage": 1, "samples_processed": 300, "duplicate_samples": 0, "check_samples": 0},
            # moved from stage 1 to 0: what it did at stage 1 is kept apart (its counters restarted)
            {"stage": 0, "samples_processed": 0, "earlier_stages": {"1": {"samples_processed": 20}}},
            {"stage": None},  # a peer that never joined a stage
        ],
    }  # fmt: skip
    out = figures(summary, per_stage=2, stages=2)
    assert out["samples_scheduled"] == 10 * GLOBAL_BATCH
    assert out["samples_processed_by_stage"] == {0: 320, 1: 320}
    assert out["duplicate_samples_by_stage"] == {0: 20, 1: 0} and out["check_samples_by_stage"] == {0: 10, 1: 0}
    assert out["retries_and_replays_share"] == 0.05 and out["failed_peers"] == 1


def test_bench_sharding_figures_average_the_peers_update_timelines():
    from scripts.bench_sharding import averaging_figures

    summary = {
        "steps": 3, "samples_per_s": 10.0,
        "peers": [
            {"update_timeline": {"updates": 3, "allreduce_s": 0.3}, "sharded_rounds": 3},
            {"update_timeline": {"updates": 3, "allreduce_s": 0.9}, "sharded_rounds": 2},
            {"stage": None},  # a peer that never joined a stage: no timeline
        ],
    }  # fmt: skip
    out = averaging_figures(summary, "reduce-scatter")
    assert out["averaging_ms_per_update"] == 200.0 and out["updates"] == 6 and out["sharded_rounds"] == 5
