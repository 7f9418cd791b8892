"""scripts/bench_pipeline.py --rounds: each round's ratios come from that round's torch and swarm
windows, and the reported figures are the medians over the rounds (not a ratio of medians)."""

from scripts.bench_pipeline import Result, _median_figures, _round_figures


def _row(name: str, samples_per_s: float, sync: str | None = None) -> Result:
    return Result(name, samples_per_s, 1.0, 40, extra={"sync": sync} if sync else {})


def test_a_round_compares_the_swarm_with_its_own_rounds_faster_torch_schedule():
    torch_rows = [_row("torch GPipe", 100.0), _row("torch 1F1B", 125.0)]
    ones = [_row("swarm exact 1/stage", 100.0, "exact"), _row("swarm async 1/stage", 150.0, "async")]
    out = _round_figures(torch_rows, ones)
    assert out["torch_gpipe_samples_per_s"] == 100.0 and out["torch_1f1b_samples_per_s"] == 125.0
    assert out["ratio_exact_vs_torch_best"] == 0.8 and out["ratio_async_vs_torch_best"] == 1.2
    # no torch side (--skip-torch): samples/s only, no ratio
    assert "ratio_exact_vs_torch_best" not in _round_figures([], ones)


def test_the_figures_are_the_medians_of_the_rounds():
    rounds = [
        {"swarm_exact_samples_per_s": 90.0, "ratio_exact_vs_torch_best": 0.9},
        {"swarm_exact_samples_per_s": 200.0, "ratio_exact_vs_torch_best": 0.5},
        {"swarm_exact_samples_per_s": 100.0, "ratio_exact_vs_torch_best": 1.0},
    ]
    out = _median_figures(rounds)
    assert out == {"swarm_exact_samples_per_s": 100.0, "ratio_exact_vs_torch_best": 0.9}
    assert _median_figures(rounds[:1]) == rounds[0]
