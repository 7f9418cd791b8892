"""`swarm status`: the swarm now, as seen from the DHT records and the peers' own Info answers."""

from __future__ import annotations

import asyncio
import json
import sys

from swarm.cluster.view import SwarmView
from swarm.core.states import PeerState
from swarm.dht.node import SwarmDHT
from swarm.training.config import RunConfig
from swarm.wire.pool import ClientPool

UNREACHABLE = "unreachable"  # listed as serving, but its Info polls fail


async def collect_status(run_id: str, initial_peers: list[str], max_events: int = 50) -> dict:
    dht = SwarmDHT(run_id, initial_peers, client_mode=True)
    clients = ClientPool()
    try:
        loop = asyncio.get_running_loop()
        text = await loop.run_in_executor(None, dht.get_config_json)
        if text is None:
            raise SystemExit(f"swarm status: no run config for run {run_id!r} on the DHT (wrong --run-id?)")
        run = RunConfig.from_json(text)
        view = SwarmView(dht, run.num_stages, clients, info_timeout_s=3.0)
        await view.refresh_dht()
        await view.poll_info(None)
        stages = []
        for k in range(run.num_stages):
            peers = []
            for s in sorted(view.peers.values(), key=lambda s: s.peer_id):
                if s.stage != k or s.record_state == PeerState.OFFLINE:
                    continue
                live = view.is_live(s)
                peers.append(
                    {
                        "id": s.peer_id,
                        "state": s.record_state.value if live else UNREACHABLE,
                        "throughput": round(s.load.throughput, 3),
                        "address": s.load.address,
                        "step": s.step,
                        "queue": int(s.load.reported_queue),
                    }
                )
            total = sum(p["throughput"] for p in peers if p["state"] == PeerState.ONLINE)
            stages.append({"index": k, "peers": peers, "throughput": round(total, 3)})
        bottleneck = min(stages, key=lambda st: st["throughput"])["index"] if stages else None
        events = []
        for raw in await loop.run_in_executor(None, dht.get_events):
            try:
                events.append(json.loads(raw))
            except ValueError:
                continue
        events.sort(key=lambda e: e.get("time", 0))
        return {
            "run_id": run_id,
            "step": view.global_step(),
            "stages": stages,
            "bottleneck": bottleneck,
            "swarm_throughput": min((st["throughput"] for st in stages), default=0.0),
            "events": events[-max_events:],
        }
    finally:
        await clients.close()
        await asyncio.get_running_loop().run_in_executor(None, dht.shutdown)


def print_status(status: dict, out=sys.stdout) -> None:
    print(
        f"run {status['run_id']}  step {status['step']}  swarm throughput {status['swarm_throughput']:.1f} samples/s",
        file=out,
    )
    for st in status["stages"]:
        mark = "  <- bottleneck" if st["index"] == status["bottleneck"] else ""
        print(f"stage {st['index']}: {len(st['peers'])} peer(s), {st['throughput']:.1f} samples/s{mark}", file=out)
        for p in st["peers"]:
            print(
                f"    {p['id'][-12:]}  {p['state']:<11} {p['throughput']:8.1f} samples/s  step {p['step']:<6} "
                f"queue {p['queue']:<3} {p['address']}",
                file=out,
            )
    if status["events"]:
        print("recent events:", file=out)
        for e in status["events"][-10:]:
            fields = {k: v for k, v in e.items() if k not in ("time", "event", "peer")}
            print(f"    {e.get('event'):<5} {e.get('peer', '')}  {json.dumps(fields)}", file=out)
