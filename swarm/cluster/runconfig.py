"""Joining a run: wait, with a deadline, for the run config the coordinator publishes on the DHT.

A wrong --run-id is told at once, not after the deadline: the DHT keeps a registry of the runs whose
config is published on it, and a run that stays absent from a non-empty registry for a few seconds is
not coming.
"""

from __future__ import annotations

import time

from swarm.core.errors import ConfigError
from swarm.dht.node import SwarmDHT
from swarm.training.config import RunConfig

# A run missing from a registry that lists others for this long is a wrong run id (its coordinator
# publishes the config before it prints its multiaddrs, so a real run is there long before).
RUN_ABSENT_GRACE_S = 4.0


def fetch_run_config(dht: SwarmDHT, timeout_s: float, absent_grace_s: float = RUN_ABSENT_GRACE_S) -> RunConfig:
    """The run's config record, polled with a growing delay (0.2 s to 2 s) until `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    absent_since: float | None = None
    while True:
        text = dht.get_config_json()
        if text is not None:
            return _parse(dht.run_id, text)
        now = time.monotonic()
        runs = dht.get_runs()
        if runs and dht.run_id not in runs:
            absent_since = now if absent_since is None else absent_since
            if now - absent_since >= absent_grace_s:
                raise ConfigError(
                    f"run {dht.run_id!r} is not on this DHT, which has run(s) {', '.join(sorted(runs))}: "
                    "check --run-id (the coordinator prints it)"
                )
        else:
            absent_since = None
        if now > deadline:
            raise ConfigError(
                f"no run config for run {dht.run_id!r} on the DHT after {timeout_s:.0f} s: is the coordinator up, "
                "and are --initial-peers and --run-id right?"
            )
        time.sleep(delay)
        delay = min(2.0, delay * 1.5)


def _parse(run_id: str, text: str) -> RunConfig:
    try:
        return RunConfig.from_json(text)
    except (TypeError, ValueError) as e:
        raise ConfigError(
            f"the run config published for run {run_id!r} cannot be used here ({e}): "
            "run the same swarm version as the coordinator"
        ) from None
