"""swarm: SWARM-parallel training of large models on a swarm of unreliable machines.

Packages, in layers (each imports only the ones below it; docs/ARCHITECTURE.md draws them, and the
import contract in pyproject.toml enforces it):
    cli                                   the `swarm` command
    local, coordinator, status, export,   entry points and tools
    sim, dashboard, netlab
    peer | trainer                        the two roles (never import each other)
    cluster                               the live view of a swarm, joining a run
    training                              models, data, optimizer, state, averaging, run config
    dht | wire | policy                   transport, and pure routing/rebalancing/pacing logic
    core                                  states, errors, settings, logging, processes, debug hooks
"""

from swarm.core.version import __version__

__all__ = ["__version__"]
