#!/usr/bin/env python
"""Wire-path benchmark: Forward round trips through a real peer's gRPC server on loopback, side by side
with a raw TCP socket echo measured in the same run.

The peer serves an identity stage (no compute), so the figure is the wire path itself: encode, send,
decode and validate on the peer, batch on its compute thread, encode, return, decode.

    python scripts/bench_wire.py [--quick] [--json]

JSON keys: ratio_vs_raw_socket, grpc_GBps, raw_socket_GBps, p50_small_ms, p99_small_ms (+ settings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from swarm.local import LocalOptions, LocalSwarm  # noqa: E402
from swarm.wire.client import StageClient  # noqa: E402
from swarm.wire.protocol import pb  # noqa: E402
from swarm.wire.tensors import WireTensor  # noqa: E402

MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- raw TCP echo, the reference ----


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def raw_socket_round_trips(nbytes: int, iterations: int) -> float:
    """Seconds per round trip of `nbytes` each way through a loopback TCP echo server."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(nbytes)
        view = memoryview(buf)
        try:
            for _ in range(iterations + 1):
                _recv_exact(conn, view)
                conn.sendall(view)
        finally:
            conn.close()

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload = os.urandom(nbytes)
    back = memoryview(bytearray(nbytes))
    times = []
    for i in range(iterations + 1):
        start = time.perf_counter()
        client.sendall(payload)
        _recv_exact(client, back)
        if i:  # the first one warms up
            times.append(time.perf_counter() - start)
    client.close()
    thread.join(timeout=10)
    server.close()
    return statistics.median(times)


# ---- gRPC through a real peer ----


async def grpc_round_trips(address: str, run_id: str, tensor: torch.Tensor, iterations: int) -> list[float]:
    client = StageClient(address)
    try:
        times = []
        for i in range(iterations + 2):
            start = time.perf_counter()
            request = pb.ForwardRequest(request_id=f"bench-{i}", run_id=run_id, stage=0, reply_codec=pb.CODEC_NONE)
            wire = WireTensor.encode(tensor, pb.CODEC_NONE)
            _, output = await client.call("forward", request, {"input": wire}, timeout=60)
            out = output.decode()
            if i >= 2:  # two warm-up calls
                times.append(time.perf_counter() - start)
            if out.shape != tensor.shape:
                raise RuntimeError(f"identity stage returned shape {tuple(out.shape)}")
        return times
    finally:
        await client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few iterations, for the test suite")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    parser.add_argument("--mib", type=int, default=16, help="size of the large activation, MiB (default 16)")
    args = parser.parse_args()
    large_iters, small_iters = (3, 30) if args.quick else (20, 400)
    dim = 1 << 18  # floats per sample; batch = size / dim
    batch = max(1, args.mib * MiB // (4 * dim))
    large = torch.randn(batch, dim)
    small = torch.randn(1, 16 * 1024)  # 64 KiB
    spec = {"kind": "identity", "dim": dim}
    small_spec_dim = small.shape[1]

    log(f"raw TCP loopback echo of {large.numel() * 4 / MiB:.0f} MiB x {large_iters}...")
    raw_s = raw_socket_round_trips(large.numel() * 4, large_iters)

    results: dict = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, model, tensor, iters in (
            ("large", spec, large, large_iters),
            ("small", {"kind": "identity", "dim": small_spec_dim}, small, small_iters),
        ):
            opts = LocalOptions(
                stages=2,
                run_args=["--model", json.dumps(model), "--codec", "none", "--microbatch", "1"],
                log_dir=f"{logs}/{name}",
            )
            with LocalSwarm(opts) as swarm:
                swarm.start_coordinator()
                peer = swarm.start_peer(0, extra=["--no-rebalance"])
                kib = tensor.numel() * 4 / 1024
                log(f"gRPC Forward round trips of {kib:.0f} KiB x {iters} through peer {peer.ready['address']}...")
                results[name] = asyncio.run(grpc_round_trips(peer.ready["address"], swarm.run_id, tensor, iters))

    nbytes = large.numel() * 4
    grpc_s = statistics.median(results["large"])
    small_ms = sorted(t * 1000 for t in results["small"])
    p99_index = min(len(small_ms) - 1, int(round(0.99 * (len(small_ms) - 1))))
    out = {
        "ratio_vs_raw_socket": raw_s / grpc_s,
        "grpc_GBps": 2 * nbytes / grpc_s / 1e9,
        "raw_socket_GBps": 2 * nbytes / raw_s / 1e9,
        "grpc_round_trip_ms": grpc_s * 1000,
        "raw_round_trip_ms": raw_s * 1000,
        "p50_small_ms": statistics.median(small_ms),
        "p99_small_ms": small_ms[p99_index],
        "large_bytes": nbytes,
        "small_bytes": small.numel() * 4,
        "iterations": {"large": large_iters, "small": small_iters},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "torch": torch.__version__,
    }
    print(f"{'path':<28}{'round trip':>14}{'GB/s (both ways)':>20}")
    print(f"{'raw TCP socket (loopback)':<28}{out['raw_round_trip_ms']:>11.2f} ms{out['raw_socket_GBps']:>20.2f}")
    print(f"{'gRPC Forward via a peer':<28}{out['grpc_round_trip_ms']:>11.2f} ms{out['grpc_GBps']:>20.2f}")
    print(f"ratio vs raw socket: {out['ratio_vs_raw_socket']:.2f}   (target >= 0.5)")
    p50, p99 = out["p50_small_ms"], out["p99_small_ms"]
    print(f"64 KiB Forward round trip: p50 {p50:.2f} ms, p99 {p99:.2f} ms   (target p50 < 1 ms)")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
