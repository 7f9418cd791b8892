"""Metrics of simulated runs: the per-run summary, a readable table, the JSON document and PNG plots.

Plots use matplotlib's Agg backend (no display needed); matplotlib is imported only when plotting, so the
simulation workers stay light.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from swarm.sim.config import RunResult

logger = logging.getLogger(__name__)

POLICY_COLORS = {"ours": "tab:blue", "weighted": "tab:orange", "uniform": "tab:red"}
SMOOTH_WINDOWS = 5  # the throughput curves are rolling means: one window holds only tens of completions


def _rolling_mean(values: list[float], n: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v - (values[i - n] if i >= n else 0.0)
        out.append(acc / min(i + 1, n))
    return out


def headline(results: list[RunResult]) -> RunResult:
    """The configuration the figures are quoted for: ours with rebalancing, else the first run."""
    for r in results:
        if r.policy == "ours" and r.rebalance:
            return r
    return results[0]


def json_document(results: list[RunResult], wall_s: float) -> dict:
    """The one-line JSON: the headline run's figures at the top level, every run under "runs"."""
    head = headline(results).summary()
    doc = {
        "peers": head["peers"],
        "stages": head["stages"],
        "sim_seconds": head["sim_seconds"],
        "policy": head["policy"],
        "rebalance": head["rebalance"],
        "throughput_fraction_of_ideal": head["throughput_fraction_of_ideal"],
        "moves": head["moves"],
        "throughput": head["throughput"],
        "ideal_throughput": head["ideal_throughput"],
        "latency_p50_s": head["latency_p50_s"],
        "latency_p99_s": head["latency_p99_s"],
        "wasted_work_fraction": head["wasted_work_fraction"],
        "fraction_of_ideal_with_overheads": head["fraction_of_ideal_with_overheads"],
        "sync": head["sync"],
        "polling": head["polling"],
        "steps": head["steps"],
        "step_s": head["step_s"],
        "update_s": head["update_s"],
        "allreduce_s": head["allreduce_s"],
        "overheads": head["overheads"],
        "hops": head["hops"],
        "cpu_s": head["cpu_s"],
        "wall_s": round(wall_s, 2),
        "runs": [r.summary() for r in results],
    }
    return doc


def format_table(results: list[RunResult]) -> str:
    cols = [
        ("policy", "{:<8}", lambda r: r.policy),
        ("rebal", "{:<5}", lambda r: "on" if r.rebalance else "off"),
        ("of ideal", "{:>8}", lambda r: f"{r.throughput_fraction_of_ideal:.1%}"),
        ("placement", "{:>9}", lambda r: f"{r.placement_fraction_of_ideal:.1%}"),
        ("samples/s", "{:>10}", lambda r: f"{r.throughput:.0f}"),
        ("ideal", "{:>8}", lambda r: f"{r.ideal_throughput:.0f}"),
        ("p50 s", "{:>7}", lambda r: "-" if r.latency_p50_s is None else f"{r.latency_p50_s:.0f}"),
        ("p99 s", "{:>7}", lambda r: "-" if r.latency_p99_s is None else f"{r.latency_p99_s:.0f}"),
        ("w/ overh", "{:>8}", lambda r: f"{r.fraction_of_ideal_with_overheads:.1%}"),
        ("wasted", "{:>7}", lambda r: f"{r.wasted_work_fraction:.2%}"),
        ("steps", "{:>5}", lambda r: str(r.steps)),
        ("round s", "{:>7}", lambda r: "-" if r.update_s is None else f"{r.update_s:.1f}"),
        ("poll cpu", "{:>8}", lambda r: f"{r.overheads.get('info_cpu_share', 0.0):.1%}"),
        ("retries", "{:>7}", lambda r: str(r.retries)),
        ("moves", "{:>6}", lambda r: str(r.moves)),
        ("warmup", "{:>6}", lambda r: f"{r.warmup_s:.0f}"),
        ("cpu s", "{:>6}", lambda r: f"{r.cpu_s:.1f}"),
    ]
    lines = [" ".join(fmt.format(name) for name, fmt, _ in cols)]
    lines += [" ".join(fmt.format(get(r)) for _, fmt, get in cols) for r in results]
    return "\n".join(lines)


def write_results(results: list[RunResult], configs: list[dict], out_dir: Path, wall_s: float) -> Path:
    """Everything, series included, for later plotting or comparison."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    doc = json_document(results, wall_s)
    doc["configs"] = configs
    doc["series"] = [{"policy": r.policy, "rebalance": r.rebalance, **r.series} for r in results]
    path.write_text(json.dumps(doc, indent=1))
    return path


def plot(results: list[RunResult], out_dir: Path) -> list[Path]:
    """throughput_over_time.png (one panel per rebalancing setting) and summary.png (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "throughput_over_time.png", out_dir / "summary.png"]
    for path, draw in zip(paths, (_plot_over_time, _plot_summary), strict=True):
        fig = draw(plt, results)
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return paths


def _plot_over_time(plt, results: list[RunResult]):
    settings = sorted({r.rebalance for r in results}, reverse=True)
    head = results[0]
    fig, axes = plt.subplots(1, len(settings), figsize=(6.5 * len(settings), 4.2), sharey=True, squeeze=False)
    for ax, on in zip(axes[0], settings, strict=True):
        runs = [r for r in results if r.rebalance == on]
        for r in runs:
            t = [x / 60 for x in r.series["t"]]
            smooth = _rolling_mean(r.series["throughput"], SMOOTH_WINDOWS)
            ax.plot(t, smooth, color=POLICY_COLORS.get(r.policy), lw=1.4, label=r.policy)
        ref = headline(runs)
        t = [x / 60 for x in ref.series["t"]]
        ax.plot(t, ref.series["ideal"], "k--", lw=1.2, label="ideal assignment")
        ax.plot(t, ref.series["placement"], "k:", lw=1.0, label=f"current assignment ({ref.policy})")
        # completions count only work done in the simulation, so they ramp up over the first trip
        ax.axvspan(0, ref.warmup_s / 60, color="grey", alpha=0.12, lw=0, label="warm-up (not averaged)")
        ax.set_title(f"rebalancing {'on' if on else 'off'}")
        ax.set_xlabel("simulated minutes")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"samples/s completed (mean of {SMOOTH_WINDOWS} windows)")
    fig.suptitle(f"{head.peers} peers, {head.stages} stages: swarm throughput vs the ideal assignment's")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _plot_summary(plt, results: list[RunResult]):
    settings = sorted({r.rebalance for r in results}, reverse=True)
    head = results[0]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    policies = [p for p in POLICY_COLORS if any(r.policy == p for r in results)]
    width = 0.8 / max(1, len(settings))
    for j, on in enumerate(settings):
        fr, p99 = [], []
        for p in policies:
            r = next((r for r in results if r.policy == p and r.rebalance == on), None)
            fr.append(r.throughput_fraction_of_ideal if r else 0.0)
            p99.append((r.latency_p99_s or 0.0) if r else 0.0)
        xs = [i + (j - (len(settings) - 1) / 2) * width for i in range(len(policies))]
        label = f"rebalancing {'on' if on else 'off'}"
        bars = ax1.bar(xs, fr, width, label=label, alpha=1.0 if on else 0.55, color="tab:blue" if on else "tab:grey")
        ax1.bar_label(bars, labels=[f"{v:.0%}" for v in fr], fontsize=8)
        ax2.bar(xs, p99, width, label=label, alpha=1.0 if on else 0.55, color="tab:blue" if on else "tab:grey")
    ax1.axhline(0.9, color="k", ls="--", lw=0.8)
    ax1.set_ylim(0, 1.1)
    ax1.set_ylabel("throughput / ideal (after warm-up)")
    ax2.set_ylabel("microbatch latency p99 (s)")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(policies)), policies)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{head.peers} peers, {head.stages} stages, {head.preemptions} preemptions in {head.sim_seconds:.0f} s"
    )
    fig.tight_layout()
    return fig
