"""Serving the dashboard of a live swarm, the same way from every command that offers it (`swarm
dashboard`, `swarm coordinator --dashboard-port`, `swarm local --dashboard-port`): a DHT client node
(created on the calling thread, which must outlive it), the run config, a LiveSource, and uvicorn in
a thread of this process; it prints `dashboard: URL` once it serves."""

from __future__ import annotations

import logging
import sys

from swarm.cluster.authority import secure
from swarm.cluster.runconfig import fetch_signed_config
from swarm.dashboard.collector import LiveSource
from swarm.dashboard.config import DashboardConfig
from swarm.dashboard.server import DashboardServer
from swarm.dht.node import SwarmDHT
from swarm.training.config import RunConfig
from swarm.wire.auth import MemberCredentials

logger = logging.getLogger(__name__)

CONFIG_TIMEOUT_S = 60.0


class LiveDashboard:
    """A dashboard of the run `run_id` served from this process until `stop()`."""

    def __init__(
        self,
        run_id: str,
        initial_peers: list[str],
        cfg: DashboardConfig,
        dht: SwarmDHT | None = None,
        run: RunConfig | None = None,
        run_key: str | None = None,
        credentials: MemberCredentials | None = None,
        invite: str | None = None,
    ) -> None:
        """Either a DHT node and the run's config (the coordinator's own), or join with `run_key` and,
        for a private swarm, `invite` (or ready `credentials`)."""
        self.own_dht = dht is None
        self.dht = dht or SwarmDHT(run_id, initial_peers, client_mode=True)
        self.keeper = None
        if run is None:
            signed = fetch_signed_config(self.dht, CONFIG_TIMEOUT_S, run_key)
            run = signed.run
            self.keeper = secure(self.dht, signed, invite, "observer")
            credentials = credentials or (self.keeper.credentials if self.keeper else None)
        self.run = run
        self.source = LiveSource(self.dht, self.run)
        self.source.clients.credentials = credentials
        self.server = DashboardServer(self.source, cfg.host, cfg.port, cfg.refresh_s)
        self.url = ""

    def start(self) -> str:
        self.url = self.server.start()
        print(f"dashboard: {self.url}", file=sys.stdout, flush=True)
        return self.url

    def stop(self) -> None:
        self.server.stop()
        if self.keeper is not None:
            self.keeper.stop()
        if self.own_dht:
            self.dht.shutdown()
