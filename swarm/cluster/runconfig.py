"""Joining a run: wait, with a deadline, for the run config the coordinator publishes on the DHT."""

from __future__ import annotations

import time

from swarm.core.errors import ConfigError
from swarm.dht.node import SwarmDHT
from swarm.training.config import RunConfig


def fetch_run_config(dht: SwarmDHT, timeout_s: float) -> RunConfig:
    """The run's config record, polled with a growing delay (0.2 s to 2 s) until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        text = dht.get_config_json()
        if text is not None:
            return RunConfig.from_json(text)
        if time.monotonic() > deadline:
            raise ConfigError(
                f"no run config for run {dht.run_id!r} on the DHT after {timeout_s:.0f} s: is the coordinator up, "
                "and are --initial-peers and --run-id right?"
            )
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)
