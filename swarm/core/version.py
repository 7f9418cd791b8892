"""The package's version (peers announce it; run configs and checkpoints record it)."""

__version__ = "0.1.0"
