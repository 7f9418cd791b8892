"""Figures of a swarm over shaped networks (`swarm local --netns`), for docs/NETWORKS.md. Root only.

    python scripts/bench_netns.py codecs  --steps 20            # samples/s per codec under "internet"
    python scripts/bench_netns.py codecs  --link-mbit 10        # the same with every link at 10 Mbit/s
    python scripts/bench_netns.py mixed   --steps 30            # who gets the microbatches under "mixed"
    python scripts/bench_netns.py moves                         # join and move times under "internet"
    python scripts/bench_netns.py inputs --link-mbit 10         # backwards with and without their kept input
    python scripts/bench_netns.py all --plot docs/networks.png  # all three, and the plot
    python scripts/bench_netns.py plot --results R.json --plot docs/networks.png   # the plot of saved results

Each part prints one JSON object per line; `all` ends with one object holding every part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarm.local import LocalOptions, LocalSwarm  # noqa: E402

MODEL = {"kind": "gpt", "vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layers": 3, "n_heads": 4, "d_ff": 256}


def run_args(codec: str = "fp16", **extra: str) -> list[str]:
    args = ["--model", json.dumps(MODEL), "--global-batch", "32", "--microbatch", "8", "--codec", codec]
    for key, value in extra.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return args


def make(tmp: str, netns: str, layout: list[int], steps: int, run: list[str], peer_args: list[str]) -> LocalSwarm:
    opts = LocalOptions(
        stages=len(layout), stage_layout=layout, trainers=1, steps=steps, netns=netns, log_dir=tmp,
        run_args=run, peer_args=peer_args,
    )  # fmt: skip
    return LocalSwarm(opts)


def train(swarm: LocalSwarm, timeout: float = 1800) -> dict:
    swarm.start()
    swarm.start_trainers()
    (summary,) = swarm.wait_trainers(timeout)
    return summary


def codecs(steps: int, link_mbit: float | None = None) -> list[dict]:
    """3 stages x 2 peers under "internet" (link_mbit: every link at that rate instead of 100 Mbit/s), the layout
    held (no rebalancing: moves would change what is compared)."""
    rows = []
    for codec in ("none", "fp16", "int8"):
        with tempfile.TemporaryDirectory() as tmp:
            with make(tmp, shaped(tmp, link_mbit), [2, 2, 2], steps, run_args(codec), ["--no-rebalance"]) as s:
                summary = train(s)
        row = {"codec": codec, "link_mbit": link_mbit or 100, "samples_per_s": round(summary["samples_per_s"], 2),
               "loss_last": round(summary["loss_last"], 3), "steps": summary["steps"]}  # fmt: skip
        print(json.dumps({"part": "codecs", **row}), flush=True)
        rows.append(row)
    return rows


def shaped(tmp: str, link_mbit: float | None) -> str:
    """The "internet" profile, with every link at `link_mbit` if given."""
    if not link_mbit:
        return "internet"
    profile = Path(tmp) / "profile.yaml"
    profile.write_text(f"extends: internet\ndefault: {{rate_mbit: {link_mbit}}}\n")
    return str(profile)


def inputs(steps: int, link_mbit: float | None, rounds: int) -> dict:
    """3 stages x 1 peer under "internet", exact mode: backwards sent back to their forward's peer without the
    input it keeps (the default) against always with it (--no-leave-out-kept-inputs), alternated `rounds` times."""
    runs: dict[str, list[dict]] = {"left_out": [], "always_sent": []}
    for _ in range(rounds):
        for name, extra in (("left_out", []), ("always_sent", ["--no-leave-out-kept-inputs"])):
            with tempfile.TemporaryDirectory() as tmp:
                args = run_args("fp16", sync="exact")
                with make(tmp, shaped(tmp, link_mbit), [1, 1, 1], steps, args, ["--no-rebalance"]) as s:
                    s.opts.trainer_args = ["--val-samples", "0", *extra]
                    summary = train(s)
            row = {"samples_per_s": round(summary["samples_per_s"], 2), "loss_last": summary["loss_last"]}
            row.update({k: summary[k] for k in ("inputs_left_out", "inputs_resent")})
            print(json.dumps({"part": "inputs", "run": name, "link_mbit": link_mbit or 100, **row}), flush=True)
            runs[name].append(row)
    median = {name: round(statistics.median(r["samples_per_s"] for r in rows), 2) for name, rows in runs.items()}
    return {"link_mbit": link_mbit or 100, "steps": steps, "rounds": rounds, "runs": runs,
            "median_samples_per_s": median, "ratio": round(median["left_out"] / median["always_sent"], 3),
            "same_loss": len({r["loss_last"] for rows in runs.values() for r in rows}) == 1}  # fmt: skip


def peer_rows(swarm: LocalSwarm) -> list[dict]:
    hosts = swarm.lab.hosts()
    rows = []
    for proc in swarm.peers:
        c, link = proc.counters or {}, hosts[proc.name].link
        rows.append({"peer": proc.name, "stage": c.get("stage"), "rate_mbit": link.rate_mbit,
                     "delay_ms": link.delay_ms, "samples": c.get("samples_processed", 0)})  # fmt: skip
    for row in rows:
        total = sum(r["samples"] for r in rows if r["stage"] == row["stage"])
        row["share_of_stage"] = round(row["samples"] / total, 3) if total else None
        row["fair_share"] = round(1 / sum(1 for r in rows if r["stage"] == row["stage"]), 3)
    return rows


def mixed(steps: int) -> dict:
    """3 stages x 3 peers, one peer in three on a slow link: without rebalancing (who gets the microbatches),
    then from a 5,2,2 layout with rebalancing (which layout it reaches)."""
    out = {}
    still = ["--no-rebalance"]
    with tempfile.TemporaryDirectory() as tmp, make(tmp, "mixed", [3, 3, 3], steps, run_args(), still) as s:
        summary = train(s)
        s.stop()
        out["wiring"] = {"samples_per_s": round(summary["samples_per_s"], 2), "peers": peer_rows(s)}
    print(json.dumps({"part": "mixed-wiring", **out["wiring"]}), flush=True)
    fast = ["--rebalance-period", "8", "--move-cooldown", "20"]
    with tempfile.TemporaryDirectory() as tmp, make(tmp, "mixed", [5, 2, 2], steps * 2, run_args(), fast) as s:
        summary = train(s)
        s.stop()
        rows = peer_rows(s)
        layout = [sum(1 for r in rows if r["stage"] == k) for k in range(3)]
        slow = [[r["stage"] for r in rows if r["rate_mbit"] == 20]]
        out["rebalancing"] = {"start_layout": [5, 2, 2], "end_layout": layout, "slow_peers_end_stages": slow[0],
                              "samples_per_s": round(summary["samples_per_s"], 2), "moves": moves_of(s)}  # fmt: skip
    print(json.dumps({"part": "mixed-rebalancing", **out["rebalancing"]}), flush=True)
    return out


def moves_of(swarm: LocalSwarm) -> list[float]:
    """Seconds of every move, from the peers' logs ("moved from stage A to stage B in X s")."""
    seconds = []
    for proc in swarm.peers:
        for line in Path(proc.log_path).read_text(errors="replace").splitlines():
            if "moved from stage" in line:
                seconds.append(float(line.rsplit(" in ", 1)[1].split()[0]))
    return seconds


def joins_of(swarm: LocalSwarm) -> list[float]:
    seconds = []
    for proc in swarm.peers:
        for line in Path(proc.log_path).read_text(errors="replace").splitlines():
            if "joined stage" in line:
                seconds.append(float(line.rsplit(" in ", 1)[1].split()[0]))
    return seconds


def moves(steps: int) -> dict:
    """Under "internet": a 3,1,1 layout (one peer moves to balance it), and one peer joining mid-run."""
    fast = ["--rebalance-period", "6", "--move-cooldown", "10"]
    with tempfile.TemporaryDirectory() as tmp, make(tmp, "internet", [3, 1, 1], steps, run_args(), fast) as s:
        s.start()
        s.start_trainers()
        time.sleep(5)
        t0 = time.monotonic()
        late = s.start_peer("auto", wait=True)
        spawn_to_ready = time.monotonic() - t0
        s.wait_trainers(1800)
        s.stop()
        out = {"join_s": joins_of(s), "late_join_spawn_to_ready_s": round(spawn_to_ready, 2),
               "late_join_stage": late.ready["stage"], "move_s": moves_of(s)}  # fmt: skip
    print(json.dumps({"part": "moves", **out}), flush=True)
    return out


def plot(result: dict, path: str) -> None:
    """Left: samples/s per codec (one group per link rate). Right: each peer's share of its stage's microbatches
    under "mixed" (red: the slow links), against an equal share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 2]})
    rows = result["codecs"] + result.get("codecs_slow", [])
    rates = sorted({r["link_mbit"] for r in rows}, reverse=True)
    for i, codec in enumerate(("none", "fp16", "int8")):
        values = [next((r["samples_per_s"] for r in rows if r["codec"] == codec and r["link_mbit"] == m), 0)
                  for m in rates]  # fmt: skip
        axes[0].bar([j + 0.27 * (i - 1) for j in range(len(rates))], values, width=0.27, label=codec)
    axes[0].set_xticks(range(len(rates)), [f"{m:g} Mbit/s links" for m in rates])
    axes[0].set_ylabel("samples/s")
    axes[0].set_title('codecs, "internet" delays')
    axes[0].legend()
    peers = sorted(result["mixed"]["wiring"]["peers"], key=lambda r: (r["stage"], r["peer"]))
    colors = ["#c44e52" if r["rate_mbit"] == 20 else "#55a868" for r in peers]
    labels = [f"{r['peer']}\n{r['rate_mbit']:g} Mbit\n{r['delay_ms']:.0f} ms" for r in peers]
    axes[1].bar(range(len(peers)), [r["share_of_stage"] for r in peers], color=colors)
    for i, r in enumerate(peers):
        axes[1].plot([i - 0.4, i + 0.4], [r["fair_share"]] * 2, color="black", linewidth=1)
    axes[1].set_xticks(range(len(peers)), labels, fontsize=7)
    axes[1].set_ylabel("share of its stage's samples")
    axes[1].set_title('"mixed": who gets the microbatches (red: slow link; line: equal share)')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["codecs", "mixed", "moves", "inputs", "all", "plot"])
    p.add_argument("--results", help="plot: a JSON file with the parts' results (codecs, codecs_slow, mixed)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--plot", help="write the plot (all) to this PNG")
    p.add_argument(
        "--link-mbit", type=float, help="codecs, inputs: every link at this rate (default: the profile's 100)"
    )
    p.add_argument("--rounds", type=int, default=2, help="inputs: alternated pairs of runs (default 2)")
    args = p.parse_args()
    result = {}
    if args.part == "plot":
        plot(json.loads(Path(args.results).read_text()), args.plot)
        return
    if args.part in ("codecs", "all"):
        result["codecs"] = codecs(args.steps, args.link_mbit)
    if args.part in ("mixed", "all"):
        result["mixed"] = mixed(args.steps)
    if args.part in ("moves", "all"):
        result["moves"] = moves(args.steps)
    if args.part == "inputs":
        print(json.dumps({"part": "inputs-summary", **inputs(args.steps, args.link_mbit, args.rounds)}), flush=True)
    if args.part == "all":
        print(json.dumps(result), flush=True)
        if args.plot:
            plot(result, args.plot)


if __name__ == "__main__":
    main()
