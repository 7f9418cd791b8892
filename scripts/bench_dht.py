#!/usr/bin/env python3
"""The DHT's CPU under what peers do, hivemind's default searches against the swarm's, side by side.

N DHT nodes (each its own hivemind DHT process and p2pd, as every peer has) each do what a peer's
records and view do: announce their stage record every 2 s, re-read every stage's record and the
accusations every 2 s, and read the accusations once per update (every 1.5 s). Two modes, one after
the other, each on fresh nodes:

- hivemind: every get and store with hivemind's default beam (its bucket size, 20: on a DHT of up to
  20 nodes every search asks every node), and a view's keys read one get each (the swarm before
  2026-12-06);
- swarm: what swarm.dht.node does now: a beam of REPLICAS nodes, a view's keys in one traversal.

Prints the CPU of the nodes' DHT processes and p2pd daemons (cores, averaged over the window) and,
as a check that the cheaper searches still find everything, how many of the N records and the one
accusation every node's last read found.

    .venv/bin/python scripts/bench_dht.py --json              # 15 nodes, 20 s window per mode
    .venv/bin/python scripts/bench_dht.py --quick --json      # 4 nodes, 3 s (the test suite's run)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.dht.node import SwarmDHT  # noqa: E402
from swarm.dht.records import Accusation, AccusationRecord, PeerRecord  # noqa: E402

STAGES = 3
ANNOUNCE_S, VIEW_S, ACCUSATIONS_S, TTL_S = 2.0, 2.0, 1.5, 8.0
WARMUP_DEADLINE_S = 30.0  # for every node's read to find every record before the window starts


def _read_like_hivemind(d: SwarmDHT) -> tuple[int, int]:
    """A view's read before: one default-beam get per key, the stage keys concurrently."""
    futures = [d.dht.get(d.stage_key(k), latest=True, return_future=True) for k in range(STAGES)]
    stages = [d._entries(d.stage_key(k), f.result(timeout=d.timeout)) for k, f in enumerate(futures)]
    accusations = d._accusations(d.dht.get(d.key("accusations"), latest=True, return_future=True).result(d.timeout))
    return sum(len(s) for s in stages), len(accusations)


def _read_like_swarm(d: SwarmDHT) -> tuple[int, int]:
    stages, accusations = d.read_view(STAGES)
    return sum(len(s) for s in stages.values()), len(accusations)


def _announce(d: SwarmDHT, stage: int, record: PeerRecord, hivemind: bool) -> None:
    if not hivemind:
        d.announce_peer(stage, record, TTL_S)
        return
    value = {**record.dict(), "cert": None}
    expiration = time.time() + TTL_S
    d.dht.store(d.stage_key(stage), subkey=d.owner, value=value, expiration_time=expiration, return_future=True).result(
        d.timeout
    )


def _worker(i: int, d: SwarmDHT, hivemind: bool, stop: threading.Event, seen: dict) -> None:
    record = PeerRecord(
        peer_id=d.peer_id, state="online", address=f"127.0.0.1:{10000 + i}", throughput=10.0, queue=0, step=0,
        version="bench",
    )  # fmt: skip
    read = _read_like_hivemind if hivemind else _read_like_swarm
    due = {"announce": 0.0, "view": 0.0, "accusations": 0.0}
    while not stop.is_set():
        now = time.monotonic()
        try:
            if now >= due["announce"]:
                _announce(d, i % STAGES, record, hivemind)
                due["announce"] = now + ANNOUNCE_S
            if now >= due["view"]:
                seen[i] = read(d)
                due["view"] = now + VIEW_S
            if now >= due["accusations"]:
                if hivemind:
                    d.dht.get(d.key("accusations"), latest=True, return_future=True).result(d.timeout)
                else:
                    d.get_accusations()
                due["accusations"] = now + ACCUSATIONS_S
        except Exception as e:  # noqa: BLE001 - a slow node under load: counted, the loop goes on
            seen.setdefault("errors", []).append(f"{type(e).__name__}: {e}")
        stop.wait(0.05)


def _wait_until_all_seen(seen: dict, nodes: int, deadline_s: float) -> bool:
    """Until every node's last read found every node's record (or the deadline passes: the figures
    then say how many were found)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if all(isinstance(seen.get(i), tuple) and seen[i][0] == nodes for i in range(nodes)):
            return True
        time.sleep(0.1)
    return False


def _cpu(procs: list[psutil.Process]) -> dict[str, float]:
    out = {"dht": 0.0, "p2pd": 0.0}
    for p in procs:
        try:
            t = p.cpu_times()
            out["p2pd" if "p2pd" in p.name() else "dht"] += t.user + t.system
        except psutil.Error:
            pass
    return out


def run_mode(mode: str, nodes: int, window_s: float) -> dict:
    hivemind = mode == "hivemind"
    # an identity per node: in one process the nodes would otherwise share one record key (one subkey)
    keys = tempfile.TemporaryDirectory()
    ids = [str(Path(keys.name) / f"node{i}.key") for i in range(nodes)]
    first = SwarmDHT("bench-dht", identity_path=ids[0])
    dhts = [first] + [SwarmDHT("bench-dht", first.visible_maddrs(), identity_path=i) for i in ids[1:]]
    stop, seen = threading.Event(), {}
    threads = []
    try:
        accusation = Accusation(
            accused="12D3KooWBench", stage=0, step=0, kind="forward", input_digest="0" * 32, accused_digest="1" * 32,
            majority_digest="2" * 32, error=1.0, witnesses=["a", "b"], time=time.time(),
        )  # fmt: skip
        first.publish_accusations(AccusationRecord(trainer_id="bench", accusations=[accusation]), 300)
        threads = [threading.Thread(target=_worker, args=(i, d, hivemind, stop, seen)) for i, d in enumerate(dhts)]
        for t in threads:
            t.start()
        _wait_until_all_seen(seen, nodes, WARMUP_DEADLINE_S)  # every node announced and is read by all
        procs = [c for c in psutil.Process().children(recursive=True) if "torch_shm" not in c.name()]
        before, t0 = _cpu(procs), time.monotonic()
        time.sleep(window_s)
        after, elapsed = _cpu(procs), time.monotonic() - t0
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
        for d in dhts:
            d.shutdown()
        keys.cleanup()
    reads = [v for k, v in seen.items() if isinstance(k, int)]
    cores = {k: round((after[k] - before[k]) / elapsed, 3) for k in after}
    return {
        "mode": mode,
        "nodes": nodes,
        "window_s": round(elapsed, 1),
        "dht_cores": cores["dht"],
        "p2pd_cores": cores["p2pd"],
        "total_cores": round(cores["dht"] + cores["p2pd"], 3),
        "min_records_seen": min((r[0] for r in reads), default=0),
        "min_accusations_seen": min((r[1] for r in reads), default=0),
        "errors": len(seen.get("errors", [])),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=15, help="DHT nodes, each its own process and p2pd (%(default)s)")
    p.add_argument("--window", type=float, default=20.0, help="seconds of load measured per mode (%(default)s)")
    p.add_argument("--quick", action="store_true", help="4 nodes, a 3 s window (the test suite's run)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.nodes, args.window = 4, 3.0
    rows = []
    for mode in ("hivemind", "swarm"):
        print(f"{mode}: {args.nodes} nodes, {args.window:.0f} s ...", file=sys.stderr, flush=True)
        rows.append(run_mode(mode, args.nodes, args.window))
    print(f"{'mode':>9} {'DHT cores':>10} {'p2pd cores':>11} {'total':>7}  records seen / accusations seen (min)")
    for r in rows:
        print(
            f"{r['mode']:>9} {r['dht_cores']:>10.3f} {r['p2pd_cores']:>11.3f} {r['total_cores']:>7.3f}  "
            f"{r['min_records_seen']} of {r['nodes']} / {r['min_accusations_seen']} of 1"
        )
    out = {"runs": rows}
    if rows[0]["total_cores"] > 0:
        out["ratio_swarm_vs_hivemind"] = round(rows[1]["total_cores"] / rows[0]["total_cores"], 3)
        print(f"swarm / hivemind CPU: {out['ratio_swarm_vs_hivemind']:.3f}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
