#!/usr/bin/env python
"""Wire-path benchmark: Forward round trips through a real peer on loopback, over its lane (plain TCP,
swarm.wire.lane: what trainers use in an open swarm) and over gRPC, side by side with a raw TCP
socket echo measured in the same run.

The peer serves an identity stage (no compute), so the figure is the wire path itself: encode, send,
decode and validate on the peer, batch on its compute thread, encode, return, decode.

    python scripts/bench_wire.py [--quick] [--json]

A bare grpc.aio unary echo of the same sizes (another process, no peer) runs in the same invocation:
the floor any Python gRPC service gets on this machine.

JSON keys: ratio_vs_raw_socket and p50_small_ms / p99_small_ms (the lane), lane_GBps,
grpc_ratio_vs_raw_socket, grpc_GBps, grpc_p50_small_ms, raw_socket_GBps, bare_grpc_round_trip_ms,
bare_grpc_ratio_vs_raw_socket, bare_grpc_p50_small_ms (+ settings).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
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


# ---- a bare grpc.aio echo: the floor of Python gRPC on this machine ----


def _bare_echo_server(ports: multiprocessing.Queue) -> None:
    import grpc

    from swarm.wire.options import server_options

    async def echo(raw: bytes, context) -> bytes:
        return raw

    async def serve() -> None:
        server = grpc.aio.server(options=server_options(256 * MiB))
        methods = {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        handler = grpc.method_handlers_generic_handler("bench.Echo", methods)
        server.add_generic_rpc_handlers((handler,))
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def bare_grpc_round_trips(sizes_iters: list[tuple[int, int]]) -> list[list[float]]:
    """Round trip times of a bare grpc.aio unary echo (another process, no peer, no tensors) for
    each (bytes, iterations): what any Python gRPC service gets here, next to the peer's figures."""
    import grpc

    from swarm.wire.options import channel_options

    ports: multiprocessing.Queue = multiprocessing.get_context("spawn").Queue()
    server = multiprocessing.get_context("spawn").Process(target=_bare_echo_server, args=(ports,), daemon=True)
    server.start()

    async def measure(port: int) -> list[list[float]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(256 * MiB)) as channel:
            call = channel.unary_unary("/bench.Echo/Echo")
            out = []
            for nbytes, iters in sizes_iters:
                payload, times = os.urandom(nbytes), []
                for i in range(iters + 2):
                    start = time.perf_counter()
                    await call(payload, timeout=60)
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                out.append(times)
            return out

    try:
        return asyncio.run(measure(ports.get(timeout=60)))
    finally:
        server.kill()
        server.join(timeout=10)


# ---- gRPC through a real peer ----


async def peer_round_trips(address: str, run_id: str, tensor: torch.Tensor, iterations: int, lane: bool) -> list[float]:
    """Forward round trips through the peer: over its lane (what trainers use in an open swarm) or
    over gRPC."""
    client = StageClient(address)
    try:
        if lane:
            info = await client.info(timeout=10)
            if not info.lane_port:
                raise RuntimeError("the peer offers no lane")
            client.set_lane(info.lane_port)
        times = []
        for i in range(iterations + 2):
            start = time.perf_counter()
            request = pb.ForwardRequest(
                request_id=f"bench-{i}", run_id=run_id, stage=0, reply_codec=pb.CODEC_NONE, validation=True
            )
            wire = WireTensor.encode(tensor, pb.CODEC_NONE)
            _, output = await client.call("forward", request, {"input": wire}, timeout=60)
            out = output.decode()
            if i >= 2:  # two warm-up calls
                times.append(time.perf_counter() - start)
            if out.shape != tensor.shape:
                raise RuntimeError(f"identity stage returned shape {tuple(out.shape)}")
        if lane and client.lane_calls < iterations:
            raise RuntimeError(f"only {client.lane_calls} of {iterations + 2} calls went over the lane")
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

    log("bare grpc.aio echo (no peer) of the same sizes...")
    bare_large, bare_small = bare_grpc_round_trips([(large.numel() * 4, large_iters), (small.numel() * 4, small_iters)])

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
                address = peer.ready["address"]
                for path, lane in (("lane", True), ("grpc", False)):
                    log(f"{path} Forward round trips of {kib:.0f} KiB x {iters} through peer {address}...")
                    results[name, path] = asyncio.run(peer_round_trips(address, swarm.run_id, tensor, iters, lane))

    nbytes = large.numel() * 4
    lane_s, grpc_s = statistics.median(results["large", "lane"]), statistics.median(results["large", "grpc"])

    def percentiles(times: list[float]) -> tuple[float, float]:
        ms = sorted(t * 1000 for t in times)
        return statistics.median(ms), ms[min(len(ms) - 1, int(round(0.99 * (len(ms) - 1))))]

    (p50, p99), (grpc_p50, grpc_p99) = percentiles(results["small", "lane"]), percentiles(results["small", "grpc"])
    out = {
        "ratio_vs_raw_socket": raw_s / lane_s,  # the path trainers use: the lane (open swarms)
        "p50_small_ms": p50,
        "p99_small_ms": p99,
        "lane_GBps": 2 * nbytes / lane_s / 1e9,
        "lane_round_trip_ms": lane_s * 1000,
        "grpc_ratio_vs_raw_socket": raw_s / grpc_s,  # private swarms (TLS, certificates) use gRPC
        "grpc_GBps": 2 * nbytes / grpc_s / 1e9,
        "grpc_round_trip_ms": grpc_s * 1000,
        "grpc_p50_small_ms": grpc_p50,
        "grpc_p99_small_ms": grpc_p99,
        "raw_socket_GBps": 2 * nbytes / raw_s / 1e9,
        "raw_round_trip_ms": raw_s * 1000,
        "bare_grpc_round_trip_ms": statistics.median(bare_large) * 1000,
        "bare_grpc_ratio_vs_raw_socket": raw_s / statistics.median(bare_large),
        "bare_grpc_p50_small_ms": statistics.median(bare_small) * 1000,
        "large_bytes": nbytes,
        "small_bytes": small.numel() * 4,
        "iterations": {"large": large_iters, "small": small_iters},
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}",
        "torch": torch.__version__,
    }
    print(f"{'path':<28}{'round trip':>14}{'GB/s (both ways)':>20}{'64 KiB p50':>14}")
    print(f"{'raw TCP socket (loopback)':<28}{out['raw_round_trip_ms']:>11.2f} ms{out['raw_socket_GBps']:>20.2f}")
    print(f"{'Forward via a peer, lane':<28}{lane_s * 1000:>11.2f} ms{out['lane_GBps']:>20.2f}{p50:>11.2f} ms")
    print(f"{'Forward via a peer, gRPC':<28}{grpc_s * 1000:>11.2f} ms{out['grpc_GBps']:>20.2f}{grpc_p50:>11.2f} ms")
    bare_gbps = 2 * nbytes / (out["bare_grpc_round_trip_ms"] / 1000) / 1e9
    bare_p50 = out["bare_grpc_p50_small_ms"]
    print(f"{'bare grpc.aio echo':<28}{out['bare_grpc_round_trip_ms']:>11.2f} ms{bare_gbps:>20.2f}{bare_p50:>11.2f} ms")
    print(f"lane ratio vs raw socket: {out['ratio_vs_raw_socket']:.2f}   (target >= 0.5)")
    print(f"64 KiB Forward round trip over the lane: p50 {p50:.2f} ms, p99 {p99:.2f} ms   (target p50 < 1 ms)")
    print(
        f"gRPC: ratio {out['grpc_ratio_vs_raw_socket']:.2f}, 64 KiB p50 {grpc_p50:.2f} ms (bare echo {bare_p50:.2f} ms)"
    )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
