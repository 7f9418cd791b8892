#!/usr/bin/env python3
"""What Info polling costs one real peer as its pollers grow: fixed periods (every poller every
0.1 s, the code before swarm.policy.polling) against the period the peer asks for (the code now).

One peer process (with its coordinator, over real gRPC on loopback); N pollers, each its own gRPC
channel (one connection, as each trainer and stage-mate has), all in this process. For each N and
each mode, for --seconds: the Info answers the peer gave per second and the CPU the peer process
used per second. Fixed periods grow linearly with N; the budget holds them at INFO_BUDGET_PER_S.

    .venv/bin/python scripts/bench_polling.py --json             # N = 10, 50, 200
    .venv/bin/python scripts/bench_polling.py --pollers 10,100 --seconds 5

Prints a table, and with --json one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402

from swarm.core.settings import INFO_PERIOD_S  # noqa: E402
from swarm.local import LocalOptions, LocalSwarm  # noqa: E402
from swarm.policy.polling import INFO_BUDGET_PER_S  # noqa: E402
from swarm.wire.protocol import pb  # noqa: E402

TINY_GPT = {"kind": "gpt", "vocab_size": 256, "seq_len": 32, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64}


def _channel(address: str):
    """A channel of its own (no subchannel shared with the others): one connection, as each trainer
    and stage-mate process has its own."""
    channel = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    call = channel.unary_unary(
        "/swarm.Stage/Info", request_serializer=pb.InfoRequest.SerializeToString,
        response_deserializer=pb.InfoResponse.FromString,
    )  # fmt: skip
    return channel, call


async def poll(address: str, pollers: int, seconds: float, follow: bool) -> int:
    """Poll for `seconds` from `pollers` channels; returns the answers received after each poller's
    first (which comes at the base period, before the poller learns the one the peer asks for)."""
    channels = [_channel(address) for _ in range(pollers)]
    answers = 0
    stop = time.monotonic() + seconds

    async def one(index: int, call) -> None:
        nonlocal answers
        period, first = INFO_PERIOD_S, True
        await asyncio.sleep(period * index / pollers)  # spread the first polls like independent processes
        while time.monotonic() < stop:
            try:
                info = await call(pb.InfoRequest(), timeout=2.0)
                answers += 0 if first else 1
                first = False
                if follow and info.poll_period_ms > 0:
                    period = max(INFO_PERIOD_S, info.poll_period_ms / 1000)
            except grpc.aio.AioRpcError:
                pass  # counted as no answer
            await asyncio.sleep(period)

    try:
        await asyncio.gather(*(one(i, call) for i, (_, call) in enumerate(channels)))
    finally:
        await asyncio.gather(*(ch.close() for ch, _ in channels), return_exceptions=True)
    return answers


def measure(address: str, pid: int, pollers: int, seconds: float, follow: bool) -> dict:
    proc = psutil.Process(pid)
    t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
    answers = asyncio.run(poll(address, pollers, seconds, follow))
    wall, cpu = time.monotonic() - t0, sum(proc.cpu_times()[:2]) - c0
    return {
        "pollers": pollers,
        "mode": "budget" if follow else "fixed",
        "answers_per_s": round(answers / wall, 1),
        "peer_cpu_per_s": round(cpu / wall, 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pollers", default="10,50,200", help="comma-separated poller counts (%(default)s)")
    p.add_argument("--seconds", type=float, default=8.0, help="seconds per measurement (%(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    p.add_argument("--quick", action="store_true", help="5 and 50 pollers, 3 s each (a check that it works)")
    args = p.parse_args(argv)
    if args.quick:
        args.pollers, args.seconds = "5,50", 3.0
    counts = [int(n) for n in args.pollers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        run_args = ["--model", json.dumps(TINY_GPT), "--global-batch", "16", "--microbatch", "4"]
        opts = LocalOptions(stages=1, peers_per_stage=1, trainers=1, log_dir=tmp, run_args=run_args)  # none started
        with LocalSwarm(opts) as swarm:
            swarm.start()
            peer = swarm.peers[0]
            address = peer.ready["address"]
            print(f"one peer at {address}; {args.seconds:.0f} s per measurement", file=sys.stderr)
            for n in counts:
                for follow in (False, True):
                    row = measure(address, peer.pid, n, args.seconds, follow)
                    rows.append(row)
                    print(
                        f"{n:>6} pollers  {row['mode']:<6}  {row['answers_per_s']:>8.1f} answers/s  "
                        f"peer CPU {row['peer_cpu_per_s']:.3f} s/s",
                        file=sys.stderr,
                        flush=True,
                    )
    print(f"{'pollers':>8} {'mode':<7} {'answers/s':>10} {'peer CPU s/s':>13}")
    for r in rows:
        print(f"{r['pollers']:>8} {r['mode']:<7} {r['answers_per_s']:>10.1f} {r['peer_cpu_per_s']:>13.3f}")
    if args.json:
        print(json.dumps({"budget_per_s": INFO_BUDGET_PER_S, "base_period_s": INFO_PERIOD_S, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
