#!/usr/bin/env python
"""What security costs: an open swarm, a private one (every call authenticated, plaintext gRPC:
`--private --no-tls`) and a private one over TLS (`--private`, the default), side by side in one run.

1. The wire: through one identity-stage peer per mode (no compute), Forward round trips of 16 MiB
   (streamed) and 64 KiB (unary), and a first call on a fresh channel (TCP + TLS handshake + Info).
   The modes take turns round by round, so a change of the machine's load hits them alike.
2. Training: `swarm local` runs with the same run config, seed and steps in each mode, in turns
   (open, private, tls, open, ...); samples/s as each run's trainer reports it, the median per mode.

    python scripts/bench_security.py [--quick] [--json] [--rounds N] [--steps N]

JSON keys: wire.MODE.{large_ms, small_p50_ms, connect_ms, GBps}, train.MODE.{samples_per_s, median},
ratios (private/open, tls/open, tls/private for each figure), settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.cluster.authority import CertificateKeeper, Invitation  # noqa: E402
from swarm.local import LocalOptions, LocalSwarm, aggregate  # noqa: E402
from swarm.wire.auth import MemberCredentials  # noqa: E402
from swarm.wire.client import StageClient  # noqa: E402
from swarm.wire.protocol import pb  # noqa: E402
from swarm.wire.tensors import WireTensor  # noqa: E402

MiB = 1 << 20
DIM = 16 * 1024  # floats per sample: one sample is 64 KiB, 256 samples (the largest batch) 16 MiB
MODES = {"open": {"private": False}, "private": {"private": True, "tls": False}, "tls": {"private": True}}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- the wire ----


def admit(swarm: LocalSwarm) -> tuple[MemberCredentials | None, CertificateKeeper | None]:
    """This process as an observer of `swarm` (nothing to do in an open one)."""
    if not swarm.invite:
        return None, None
    tls_ca = swarm.coordinator.ready.get("tls_ca", "")
    keeper = CertificateKeeper(Invitation.read(swarm.invite), b"bench-observer", "observer", tls_ca=tls_ca).start()
    return keeper.credentials, keeper


async def forward_times(client: StageClient, run_id: str, tensor: torch.Tensor, n: int) -> list[float]:
    times = []
    for i in range(n):
        start = time.perf_counter()
        request = pb.ForwardRequest(request_id=f"b-{time.time_ns()}-{i}", run_id=run_id, stage=0, reply_codec=0)
        _, output = await client.call("forward", request, {"input": WireTensor.encode(tensor, pb.CODEC_NONE)}, 60)
        if output.decode().shape != tensor.shape:
            raise RuntimeError("the identity stage changed the shape")
        times.append(time.perf_counter() - start)
    return times


async def connect_time(address: str, credentials: MemberCredentials | None) -> float:
    """A fresh channel's first call: TCP connect, the TLS handshake if any, Info."""
    client = StageClient(address, credentials=credentials)
    try:
        start = time.perf_counter()
        await client.info(timeout=30)
        return time.perf_counter() - start
    finally:
        await client.close()


async def wire_rounds(targets: dict, rounds: int, large_n: int, small_n: int) -> dict:
    """targets: mode -> (address, run_id, credentials). The modes take turns in every round."""
    large, small = torch.randn(256, DIM), torch.randn(1, DIM)
    times = {mode: {"large": [], "small": [], "connect": []} for mode in targets}
    clients = {mode: StageClient(a, credentials=c) for mode, (a, _, c) in targets.items()}
    try:
        for mode, (_, run_id, _) in targets.items():  # warm up: connections, the peer's first batches
            await forward_times(clients[mode], run_id, large, 2)
            await forward_times(clients[mode], run_id, small, 5)
        for r in range(rounds):
            for mode, (address, run_id, credentials) in targets.items():
                times[mode]["large"] += await forward_times(clients[mode], run_id, large, large_n)
                times[mode]["small"] += await forward_times(clients[mode], run_id, small, small_n)
                times[mode]["connect"] += [await connect_time(address, credentials) for _ in range(3)]
            log(f"wire round {r + 1}/{rounds} done")
    finally:
        for client in clients.values():
            await client.close()
    nbytes = large.numel() * 4
    out = {}
    for mode, t in times.items():
        large_s = statistics.median(t["large"])
        out[mode] = {
            "large_ms": large_s * 1000,
            "GBps": 2 * nbytes / large_s / 1e9,
            "small_p50_ms": statistics.median(t["small"]) * 1000,
            "connect_ms": statistics.median(t["connect"]) * 1000,
        }
    return out


def measure_wire(logs: str, rounds: int, large_n: int, small_n: int) -> dict:
    model = json.dumps({"kind": "identity", "dim": DIM})
    swarms, keepers, targets = [], [], {}
    try:
        for mode, security in MODES.items():
            opts = LocalOptions(
                stages=2, run_args=["--model", model, "--codec", "none", "--microbatch", "1"],
                log_dir=f"{logs}/wire-{mode}", **security,
            )  # fmt: skip
            swarm = LocalSwarm(opts)
            swarms.append(swarm)
            swarm.start_coordinator()
            peer = swarm.start_peer(0, extra=["--no-rebalance"])
            credentials, keeper = admit(swarm)
            keepers += [keeper] if keeper else []
            targets[mode] = (peer.ready["address"], swarm.run_id, credentials)
        log(f"wire: {rounds} rounds of {large_n} x 16 MiB, {small_n} x 64 KiB and 3 fresh channels per mode")
        return asyncio.run(wire_rounds(targets, rounds, large_n, small_n))
    finally:
        for keeper in keepers:
            keeper.stop()
        for swarm in swarms:
            swarm.stop()


# ---- training ----


def train_once(logs: str, mode: str, index: int, opts: dict) -> dict:
    log_dir = f"{logs}/train-{mode}-{index}"
    with LocalSwarm(LocalOptions(log_dir=log_dir, **opts, **MODES[mode])) as swarm:
        swarm.start()
        start = time.monotonic()
        swarm.start_trainers()
        summary = aggregate(swarm.wait_trainers(timeout=1800), time.monotonic() - start)
    if summary["steps"] != opts["steps"]:
        raise RuntimeError(f"{mode} run {index}: {summary['steps']} steps of {opts['steps']}")
    log(f"train {mode} #{index}: {summary['samples_per_s']:.1f} samples/s ({summary['wall_s']:.0f} s)")
    return summary


def measure_training(logs: str, rounds: int, opts: dict) -> dict:
    runs = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES:
            runs[mode].append(train_once(logs, mode, r, opts)["samples_per_s"])
    return {mode: {"samples_per_s": v, "median": statistics.median(v)} for mode, v in runs.items()}


def ratios(figures: dict, key: str) -> dict:
    get = lambda mode: figures[mode][key]  # noqa: E731
    return {
        "private/open": get("private") / get("open"),
        "tls/open": get("tls") / get("open"),
        "tls/private": get("tls") / get("private"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few iterations and a tiny model, for the tests")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--rounds", type=int, default=None, help="turns per mode (default 3; --quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per training run (default 40)")
    parser.add_argument("--stages", type=int, default=3, help="stages of the training runs (default 3)")
    parser.add_argument("--peers-per-stage", type=int, default=2, help="(default 2)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    large_n, small_n = (2, 10) if args.quick else (10, 100)
    train = {"stages": args.stages, "peers_per_stage": args.peers_per_stage, "steps": args.steps or 40}
    if args.quick:
        tiny = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 3, "n_heads": 2, "d_ff": 64}
        train.update(stages=2, peers_per_stage=1, steps=args.steps or 3, run_args=["--model", json.dumps(tiny)])
    train["run_args"] = [*train.get("run_args", []), "--global-batch", "16", "--microbatch", "4", "--seed", "0"]

    with tempfile.TemporaryDirectory() as logs:
        wire = measure_wire(logs, rounds, large_n, small_n)
        trained = measure_training(logs, rounds, train)
    out = {
        "wire": wire,
        "train": trained,
        "ratios": {
            "large_round_trip_ms": ratios(wire, "large_ms"),
            "small_p50_ms": ratios(wire, "small_p50_ms"),
            "connect_ms": ratios(wire, "connect_ms"),
            "samples_per_s": ratios(trained, "median"),
        },
        "settings": {"rounds": rounds, "large_n": large_n, "small_n": small_n, **train},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "load_avg": os.getloadavg(),
    }
    print(f"{'mode':<9}{'16 MiB rt ms':>14}{'GB/s':>8}{'64 KiB p50 ms':>15}{'connect ms':>12}{'samples/s':>11}")
    for mode in MODES:
        w = wire[mode]
        print(
            f"{mode:<9}{w['large_ms']:>14.1f}{w['GBps']:>8.2f}{w['small_p50_ms']:>15.2f}{w['connect_ms']:>12.1f}"
            f"{trained[mode]['median']:>11.1f}"
        )
    for what, r in out["ratios"].items():
        print(f"{what}: " + "  ".join(f"{k} {v:.3f}" for k, v in r.items()))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
