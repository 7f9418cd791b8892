#!/usr/bin/env python
"""Overheads of the swarm machinery around the torch compute, on the default local GPT:

- peer memory (RSS) beyond parameters, optimizer state and gradient accumulators;
- trainer memory per in-flight microbatch (two trainer runs, 2 and 16 microbatches in flight);
- CPU time per microbatch outside torch compute (peer process CPU time minus compute-thread time),
  and the top items of a profile of the peers' event loops (where requests are parsed, validated,
  decoded, encoded and answered).

    python scripts/bench_overheads.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.local import LocalOptions, LocalSwarm  # noqa: E402
from tests.integration.helpers import info  # noqa: E402

MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class RssSampler:
    """Peak RSS of some processes, sampled every 0.2 s in the background."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.peak = pids, dict.fromkeys(pids, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                try:
                    self.peak[name] = max(self.peak[name], psutil.Process(pid).memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.2)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_trainer(swarm: LocalSwarm, steps: int, in_flight: int) -> tuple[int, dict]:
    swarm.opts.steps = steps
    swarm.opts.trainer_args = ["--max-in-flight", str(in_flight), "--val-samples", "0"]
    swarm.trainers = []
    (trainer,) = swarm.start_trainers()
    with RssSampler({"trainer": trainer.pid}) as sampler:
        (summary,) = swarm.wait_trainers(timeout=600)
    return sampler.peak["trainer"], summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few steps (for the test suite)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args()
    steps = 6 if args.quick else 40
    run_args = ["--codec", "fp16"]
    if args.quick:
        tiny = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64}
        run_args += ["--model", json.dumps(tiny), "--global-batch", "16", "--microbatch", "4"]

    with tempfile.TemporaryDirectory() as tmp:
        profile_dir = Path(tmp) / "profiles"
        profile_dir.mkdir()
        opts = LocalOptions(
            stages=3,
            peers_per_stage=1,
            steps=steps,
            run_args=run_args,
            log_dir=f"{tmp}/logs",
            peer_args=["--no-rebalance", "--profile-dir", str(profile_dir)],
        )
        with LocalSwarm(opts) as swarm:
            swarm.start()
            peers = {f"stage{p.ready['stage']}": p for p in swarm.peers}
            cpu0 = {n: psutil.Process(p.pid).cpu_times() for n, p in peers.items()}
            info0 = {n: info(p.ready["address"]) for n, p in peers.items()}
            log(f"training {steps} steps with 16 microbatches in flight ...")
            with RssSampler({n: p.pid for n, p in peers.items()}) as peer_rss:
                rss16, summary16 = run_trainer(swarm, steps, 16)
            log(f"training {steps} more steps with 2 microbatches in flight ...")
            rss2, summary2 = run_trainer(swarm, 2 * steps, 2)
            cpu1 = {n: psutil.Process(p.pid).cpu_times() for n, p in peers.items()}
            info1 = {n: info(p.ready["address"]) for n, p in peers.items()}
            microbatch = 4 if args.quick else 8
            peer_rows = {}
            for name in peers:
                cpu = (cpu1[name].user + cpu1[name].system) - (cpu0[name].user + cpu0[name].system)
                compute = info1[name].compute_seconds - info0[name].compute_seconds
                samples = info1[name].samples_processed - info0[name].samples_processed
                calls = 2 * samples / microbatch  # a forward and a backward per microbatch
                params = info1[name].num_parameters
                state = params * 4 * (1 + 2 + 2)  # parameters, Adam's two moments, up to two accumulators
                peer_rows[name] = {
                    "rss_MiB": peer_rss.peak[name] / MiB,
                    "params_and_optimizer_MiB": state / MiB,
                    "overhead_MiB": (peer_rss.peak[name] - state) / MiB,
                    "cpu_s": cpu,
                    "compute_s": compute,
                    "cpu_outside_compute_ms_per_call": 1000 * max(0.0, cpu - compute) / max(1.0, calls),
                    "calls": calls,
                }
        # the peers dumped their profiles on their graceful exit
        stats = None
        for prof in profile_dir.glob("peer-*.prof"):
            stats = pstats.Stats(str(prof)) if stats is None else stats.add(str(prof))
        top = []
        loop_cpu_s = 0.0
        if stats is not None:
            loop_cpu_s = sum(v[2] for v in stats.stats.values())
            rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # tottime
            total = sum(v[2] for _, v in rows) or 1.0
            for (filename, line, func), (_cc, _nc, tottime, _ct, _callers) in rows[:12]:
                where = f"{Path(filename).name}:{line}" if line else filename
                top.append({"function": f"{func} ({where})", "seconds": round(tottime, 3), "share": tottime / total})

    per_microbatch = max(0.0, (rss16 - rss2) / 14 / MiB)
    out = {
        "peers": peer_rows,
        "trainer_rss_MiB": {"in_flight_16": rss16 / MiB, "in_flight_2": rss2 / MiB},
        "trainer_MiB_per_in_flight_microbatch": per_microbatch,
        "cpu_outside_compute_ms_per_call": sum(r["cpu_outside_compute_ms_per_call"] for r in peer_rows.values())
        / len(peer_rows),
        "event_loop_profile_top": top,
        # CPU time of the peers' event-loop threads (parsing, validation, codecs, gRPC handlers) per
        # Forward/Backward call: the compute thread's figure above is wall time, which a loaded
        # machine inflates past the process's CPU time; this one is thread CPU time, under cProfile
        "event_loop_cpu_ms_per_call": 1000 * loop_cpu_s / max(1.0, sum(r["calls"] for r in peer_rows.values())),
        "samples_per_s": {"in_flight_16": summary16["samples_per_s"], "in_flight_2": summary2["samples_per_s"]},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
    }
    header = ("peer", "RSS MiB", "state MiB", "overhead MiB", "CPU s", "compute s", "ms/call outside")
    print(f"{header[0]:<8}" + "".join(f"{h:>{w}}" for h, w in zip(header[1:], (9, 11, 14, 8, 11, 17), strict=True)))
    for name, r in sorted(peer_rows.items()):
        print(
            f"{name:<8}{r['rss_MiB']:>9.0f}{r['params_and_optimizer_MiB']:>11.1f}{r['overhead_MiB']:>14.0f}"
            f"{r['cpu_s']:>8.1f}{r['compute_s']:>11.1f}{r['cpu_outside_compute_ms_per_call']:>17.2f}"
        )
    print(f"trainer RSS: {rss2 / MiB:.0f} MiB with 2 in flight, {rss16 / MiB:.0f} MiB with 16:", end=" ")
    print(f"{per_microbatch:.2f} MiB per microbatch")
    print(f"peers' event-loop CPU per Forward/Backward call: {out['event_loop_cpu_ms_per_call']:.2f} ms")
    print("top of the peers' event-loop CPU profile (tottime, thread CPU time):")
    for t in top:
        print(f"  {100 * t['share']:5.1f}%  {t['seconds']:7.3f} s  {t['function']}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
