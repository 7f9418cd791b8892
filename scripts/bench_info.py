#!/usr/bin/env python3
"""What one Info exchange costs on this machine: the CPU time of the answering process (a grpc.aio
server with the peer's handler shape: a unary call answered by an InfoResponse filled like
swarm.peer.serving.ServingState.info) and of the asking one (swarm.wire.client.StageClient.info, as
swarm.cluster.view polls), and its bytes. `swarm sim --info-cost-ms` and `--info-bytes` come from it.

    python scripts/bench_info.py [--calls 20000] [--concurrency 64]

Prints one JSON line. CPU seconds are each process's own, so they hold whatever else the machine does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from swarm.wire.protocol import pb  # noqa: E402


def info_response() -> pb.InfoResponse:
    """An answer like a serving peer's (swarm.peer.serving.ServingState.info), built afresh per call."""
    return pb.InfoResponse(
        peer_id="12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBmWbDyTGAqFzNR",
        run_id="run-1",
        stage=3,
        state="online",
        throughput=123.456,
        queue_length=2,
        version="0.1.0",
        step=1234,
        samples_accumulated=640,
        accumulating_step=1234,
        uptime_ms=3_600_000,
        num_parameters=50_000_000,
        samples_processed=1_000_000,
        samples_discarded=12,
        averaging_rounds=1234,
        params_sum=-1234.5678,
        params_abs=98765.4321,
        compute_seconds=3456.7,
        samples_predicted=5000,
        epoch=2,
        ledger_steps=1234,
        fallbacks=json.dumps({"averaging_failed": 1}, separators=(",", ":")),
        note="",
    )


async def serve(port_file: str) -> None:
    import grpc

    async def info(raw: bytes, context) -> bytes:
        return info_response().SerializeToString()

    server = grpc.aio.server(maximum_concurrent_rpcs=1024)
    handler = grpc.method_handlers_generic_handler("swarm.Stage", {"Info": grpc.unary_unary_rpc_method_handler(info)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(port_file).write_text(str(port))
    await server.wait_for_termination()


async def poll(address: str, calls: int, concurrency: int) -> float:
    from swarm.wire.client import StageClient

    client = StageClient(address)
    await client.info(timeout=5.0)  # connect
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await client.info(timeout=5.0)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.channel.close()
    return elapsed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=20_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    port_file = f"/tmp/bench_info_{os.getpid()}.port"
    server = subprocess.Popen([sys.executable, __file__, "--serve", port_file])
    try:
        while not Path(port_file).exists():
            time.sleep(0.05)
        time.sleep(0.2)
        address = f"127.0.0.1:{Path(port_file).read_text()}"
        proc, me = psutil.Process(server.pid), psutil.Process()
        s0, c0 = proc.cpu_times(), me.cpu_times()
        elapsed = asyncio.run(poll(address, args.calls, args.concurrency))
        s1, c1 = proc.cpu_times(), me.cpu_times()
    finally:
        server.terminate()
        server.wait()
        Path(port_file).unlink(missing_ok=True)
    answer = (s1.user + s1.system - s0.user - s0.system) / args.calls
    ask = (c1.user + c1.system - c0.user - c0.system) / args.calls
    response = len(info_response().SerializeToString())
    doc = {
        "calls": args.calls,
        "calls_per_s": round(args.calls / elapsed, 1),
        "answer_cpu_ms": round(answer * 1000, 4),
        "ask_cpu_ms": round(ask * 1000, 4),
        "response_bytes": response,
        "request_bytes": len(pb.InfoRequest().SerializeToString()),
        "note": "gRPC adds about 50-100 bytes of HTTP/2 headers and frames each way per call",
    }
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
