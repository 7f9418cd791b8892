"""`swarm status`: the swarm now, as seen from the DHT records and the peers' own Info answers."""

from __future__ import annotations

import asyncio
import json
import sys

from swarm.cluster.authority import join_run
from swarm.cluster.fallbacks import fallback_totals
from swarm.cluster.view import SwarmView
from swarm.core.states import PeerState
from swarm.dht.node import SwarmDHT
from swarm.dht.records import newest_events
from swarm.wire.pool import ClientPool

UNREACHABLE = "unreachable"  # listed as serving, but its Info polls fail
ACCUSED = "accused"  # a trainer caught it answering differently from its mates: it gets no work
CONFIG_TIMEOUT_S = 10.0


def _stage_status(view: SwarmView, k: int) -> dict:
    peers = []
    for s in sorted(view.peers.values(), key=lambda s: s.peer_id):
        if s.stage != k or s.record_state == PeerState.OFFLINE:
            continue
        # a peer listed as serving that stopped answering is unreachable; a joining one says why it waits
        unreachable = s.record_state.serving and not view.is_live(s)
        state = ACCUSED if s.peer_id in view.accused else UNREACHABLE if unreachable else s.record_state.value
        peers.append(
            {
                "id": s.peer_id,
                "state": state,
                "throughput": round(s.load.throughput, 3),
                "address": s.load.address,
                "step": s.step,
                "queue": int(s.load.reported_queue),
                "note": s.note,
                "fallbacks": s.fallbacks,
            }
        )
    total = sum(p["throughput"] for p in peers if p["state"] == PeerState.ONLINE)
    notes = sorted({p["note"] for p in peers if p["note"]})
    fallbacks = fallback_totals(s for s in view.peers.values() if s.stage == k)
    return {"index": k, "peers": peers, "throughput": round(total, 3), "notes": notes, "fallbacks": fallbacks}


class StatusObserver:
    """Reads the swarm's status as often as asked over one DHT client node and one client pool
    (`swarm status` reads it once; a test that waits for a layout reads it every fraction of a second,
    and a new DHT node per look would cost more than the look)."""

    def __init__(self, dht: SwarmDHT, clients: ClientPool, run, keeper=None) -> None:
        self.dht, self.clients, self.run = dht, clients, run
        self.keeper = keeper  # renews a private swarm's credentials (None in an open swarm)
        self.view = SwarmView(dht, run.num_stages, clients, info_timeout_s=3.0)

    @classmethod
    async def open(
        cls, run_id: str, initial_peers: list[str], run_key: str | None = None, invite: str | None = None
    ) -> StatusObserver:
        dht = SwarmDHT(run_id, initial_peers, client_mode=True)
        clients = ClientPool()
        loop = asyncio.get_running_loop()
        try:
            signed, keeper = await loop.run_in_executor(
                None, join_run, dht, CONFIG_TIMEOUT_S, run_key, invite, "observer", clients
            )  # a wrong run id or key is a ConfigError: one line, exit code 2 (swarm.cli.main)
        except BaseException:
            await clients.close()
            await loop.run_in_executor(None, dht.shutdown)
            raise
        return cls(dht, clients, signed.run, keeper)

    async def read(self, max_events: int = 50) -> dict:
        view, run = self.view, self.run
        await view.refresh_dht()
        await view.poll_info(None)
        stages = [_stage_status(view, k) for k in range(run.num_stages)]
        bottleneck = min(stages, key=lambda st: st["throughput"])["index"] if stages else None
        events = []
        for raw in await asyncio.get_running_loop().run_in_executor(None, self.dht.get_events):
            try:
                events.append(json.loads(raw))
            except ValueError:
                continue
        return {
            "run_id": run.run_id,
            "security": "private" if run.private else "open",
            "tls": bool(run.tls_ca),
            "step": view.global_step(),
            "stages": stages,
            "bottleneck": bottleneck,
            "swarm_throughput": min((st["throughput"] for st in stages), default=0.0),
            "events": newest_events([e for e in events if isinstance(e, dict)], max_events),
        }

    async def close(self) -> None:
        if self.keeper is not None:
            self.keeper.stop()
        await self.clients.close()
        await asyncio.get_running_loop().run_in_executor(None, self.dht.shutdown)


async def collect_status(
    run_id: str, initial_peers: list[str], max_events: int = 50, run_key: str | None = None, invite: str | None = None
) -> dict:
    observer = await StatusObserver.open(run_id, initial_peers, run_key, invite)
    try:
        return await observer.read(max_events)
    finally:
        await observer.close()


def print_status(status: dict, out=sys.stdout) -> None:
    print(
        f"run {status['run_id']} ({status.get('security', 'open')} swarm{', TLS' if status.get('tls') else ''})  "
        f"step {status['step']}  "
        f"swarm throughput {status['swarm_throughput']:.1f} samples/s",
        file=out,
    )
    for st in status["stages"]:
        mark = "  <- bottleneck" if st["index"] == status["bottleneck"] else ""
        print(f"stage {st['index']}: {len(st['peers'])} peer(s), {st['throughput']:.1f} samples/s{mark}", file=out)
        for note in st.get("notes", []):
            print(f"    ! {note}", file=out)
        if st.get("fallbacks"):
            taken = ", ".join(f"{kind} x{n}" for kind, n in sorted(st["fallbacks"].items()))
            print(f"    off the normal path: {taken}", file=out)
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
