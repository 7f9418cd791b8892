"""The dashboard's settings (its command-line flags are generated from them): a module of its own, so
that `swarm`'s parser and the processes that never serve a dashboard do not import the web stack."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.core.settings import setting


@dataclass
class DashboardConfig:
    host: str = setting("127.0.0.1", "interface the dashboard listens on (it is read-only; 0.0.0.0 for all)")
    port: int = setting(8080, "port of the dashboard (0: any free port)")
    refresh_s: float = setting(1.0, "seconds between the dashboard's looks at the swarm (and the page's updates)")
