"""swarm: SWARM-parallel training of large models on a swarm of unreliable machines."""

__version__ = "0.1.0"
