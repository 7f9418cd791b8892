"""The coordinator dashboard's web side: a state document in, a live read-only web app out.

`source` defines what feeds it (`StateSource`), `app` the Starlette app (page, JSON API, Prometheus
metrics), `server` how it is served (a background thread or the current event loop), and `synthetic`
a generator of realistic documents for tests, demos and benchmarks.
"""

from swarm.dashboard.app import create_app
from swarm.dashboard.server import DashboardServer, serve_forever
from swarm.dashboard.source import PEER_STATES, StateSource
from swarm.dashboard.synthetic import SyntheticSource, synthetic_state

__all__ = [
    "PEER_STATES",
    "DashboardServer",
    "StateSource",
    "SyntheticSource",
    "create_app",
    "serve_forever",
    "synthetic_state",
]
