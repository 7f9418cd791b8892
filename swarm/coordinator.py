"""The coordinator: a DHT bootstrap node that publishes the run config.

It holds no training state: if it dies, peers and trainers go on (peers keep the DHT alive and
re-publish the run config they hold when its record disappears).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal

from swarm.training.config import RunConfig
from swarm.dht.node import Announcer, SwarmDHT
from swarm.core.log import set_context
from swarm.core.procs import READY_PREFIX

logger = logging.getLogger(__name__)

CONFIG_TTL = 120.0
CONFIG_PERIOD = 20.0


async def run_coordinator(
    run: RunConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    announce_host: str | None = None,
    maddrs_file: str | None = None,
) -> int:
    text = run.to_json()  # validates size before anything starts
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    dht = SwarmDHT(run.run_id, [], host=host, port=port, announce_host=announce_host)  # main thread: see swarm.dht.node
    set_context(peer=dht.peer_id[-6:])
    announcer = Announcer(lambda ttl: dht.publish_config(text, ttl), CONFIG_PERIOD, CONFIG_TTL, name="config-announcer")
    announcer.start()
    try:
        maddrs = dht.visible_maddrs()
        if announce_host:
            maddrs = [m for m in maddrs if f"/ip4/{announce_host}/" in m] or maddrs
        if maddrs_file:
            tmp = f"{maddrs_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write("\n".join(maddrs) + "\n")
            os.replace(tmp, maddrs_file)  # atomic: readers never see a half-written file
        ready = {"role": "coordinator", "run_id": run.run_id, "initial_peers": maddrs, "pid": os.getpid()}
        print(READY_PREFIX + json.dumps(ready), flush=True)
        logger.info(
            "run %s: join with  swarm peer --run-id %s --initial-peers %s", run.run_id, run.run_id, " ".join(maddrs)
        )
        await stop.wait()
        return 0
    finally:
        await loop.run_in_executor(None, announcer.stop)
        await loop.run_in_executor(None, dht.shutdown)
