"""The coordinator: a DHT bootstrap node that publishes the run config.

It holds no training state: if it dies, peers and trainers go on (peers keep the DHT alive and
re-publish the run config they hold when its record disappears).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
from dataclasses import dataclass

from swarm.cluster.authority import self_credentials, serve_authority
from swarm.cluster.runconfig import SignedConfig
from swarm.core.keys import SigningKey
from swarm.core.log import set_context
from swarm.core.procs import READY_PREFIX
from swarm.core.settings import setting
from swarm.core.tls import RunCA
from swarm.dht.announcer import Announcer
from swarm.dht.node import SwarmDHT
from swarm.training.config import RunConfig

logger = logging.getLogger(__name__)

CONFIG_TTL_S = 120.0
CONFIG_PERIOD_S = 20.0


@dataclass
class CoordinatorConfig:
    host: str = setting("127.0.0.1", "interface of the DHT node (0.0.0.0 for all)")
    port: int = setting(0, "DHT port (0: any free port)")
    announce_host: str | None = setting(None, "IP address other machines reach the coordinator at")
    maddrs_file: str | None = setting(None, "also write the multiaddrs to join with to this file (for scripts)")
    dashboard_port: int | None = setting(None, "also serve the dashboard on this port (0: any free port)")
    dashboard_host: str = setting("127.0.0.1", "interface of the dashboard (read-only; 0.0.0.0 for all)")
    initial_peers: list[str] = setting(
        factory=list,
        help="multiaddrs of a running swarm, to restart its coordinator (default: start a new DHT)",
        metavar="MULTIADDR",
    )
    private: bool = setting(False, "a private swarm: only members this coordinator admits may call peers or publish")
    invite_file: str | None = setting(
        None, "private: write the invitation members join with here (--invite FILE); default RUN_ID.invite.json"
    )
    allowlist: str | None = setting(None, "private: also admit the member keys in this file (base64, one a line)")
    authority_port: int = setting(0, "private: port of the admission service (0: any free port)")
    tls: bool = setting(
        True, "private: the peers' gRPC and the admission over TLS, under a CA derived from the run key (--no-tls: "
        "plaintext; the calls are still authenticated)",
    )  # fmt: skip
    run_key_path: str | None = setting(
        None,
        "the run's private key (created there if missing; keep it to restart the coordinator of the same run); "
        "default: a new key for this run, not saved",
    )


def _publish_maddrs(dht: SwarmDHT, announce_host: str | None, maddrs_file: str | None) -> list[str]:
    """The multiaddrs others join through (on the announced host if one is given), also written to
    `maddrs_file` atomically: readers never see a half-written file."""
    maddrs = dht.visible_maddrs()
    if announce_host:
        maddrs = [m for m in maddrs if f"/ip4/{announce_host}/" in m] or maddrs
    if maddrs_file:
        tmp = f"{maddrs_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(maddrs) + "\n")
        os.replace(tmp, maddrs_file)
    return maddrs


async def _start_authority(run: RunConfig, cfg: CoordinatorConfig, key: SigningKey, ca: RunCA | None, dht: SwarmDHT):
    """A private swarm's admission service, and the coordinator's own membership (its dashboard)."""
    invite_file = cfg.invite_file or f"{run.run_id}.invite.json"
    authority, _ = await serve_authority(
        run.run_id, key, cfg.host, cfg.announce_host, cfg.authority_port, invite_file, cfg.allowlist, ca=ca
    )
    credentials = self_credentials(key, run.run_id, dht, tls_ca=ca.pem if ca is not None else None)
    tls = f"gRPC over TLS (CA {ca.fingerprint})" if ca is not None else "plaintext gRPC (--no-tls)"
    logger.info("private swarm, %s: members join with --invite %s", tls, invite_file)
    return authority, credentials


async def run_coordinator(run: RunConfig, cfg: CoordinatorConfig) -> int:
    key = SigningKey.load_or_create(cfg.run_key_path) if cfg.run_key_path else SigningKey.generate()
    ca = RunCA.derive(key) if run.private and cfg.tls else None  # the same run key: the same CA
    run = dataclasses.replace(run, tls_ca=ca.fingerprint if ca is not None else "")
    text = SignedConfig.sign(run, key).to_text()  # validates the config's size before anything starts
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    host, announce_host = cfg.host, cfg.announce_host
    # on the main thread, which outlives the DHT process (see swarm.dht.node)
    dht = SwarmDHT(run.run_id, cfg.initial_peers, host=host, port=cfg.port, announce_host=announce_host)
    set_context(peer=dht.peer_id[-6:])
    announcer = Announcer(
        lambda ttl: dht.publish_config(text, ttl), CONFIG_PERIOD_S, CONFIG_TTL_S, name="config-announcer"
    )
    announcer.start()
    dashboard = authority = credentials = None
    try:
        if run.private:
            authority, credentials = await _start_authority(run, cfg, key, ca, dht)
        maddrs = _publish_maddrs(dht, announce_host, cfg.maddrs_file)
        if cfg.dashboard_port is not None:  # the same DHT node feeds it (created on this thread)
            # imported here: the dashboard's web stack is not needed by every process that imports this
            from swarm.dashboard.live import DashboardConfig, LiveDashboard

            dashboard = LiveDashboard(
                run.run_id, maddrs, DashboardConfig(cfg.dashboard_host, cfg.dashboard_port), dht=dht, run=run,
                credentials=credentials,
            )  # fmt: skip
            dashboard.start()
        ready = {
            "role": "coordinator",
            "run_id": run.run_id,
            "run_key": key.fingerprint,
            "initial_peers": maddrs,
            "pid": os.getpid(),
        }
        if dashboard is not None:
            ready["dashboard"] = dashboard.url
        if ca is not None:
            ready["tls_ca"] = ca.fingerprint
        if run.private:
            ready["invite_file"] = os.path.abspath(cfg.invite_file or f"{run.run_id}.invite.json")
        print(READY_PREFIX + json.dumps(ready), flush=True)
        logger.info(
            "run %s: join with  swarm peer --run-id %s --run-key %s%s --initial-peers %s",
            run.run_id, run.run_id, key.fingerprint, f" --invite {ready['invite_file']}" if run.private else "",
            " ".join(maddrs),
        )  # fmt: skip
        await stop.wait()
        return 0
    finally:
        if dashboard is not None:
            await loop.run_in_executor(None, dashboard.stop)
        if authority is not None:
            await authority.stop(grace=1.0)
        await loop.run_in_executor(None, announcer.stop)
        await loop.run_in_executor(None, dht.shutdown)
