"""The processes of one run placed on the hosts of a network lab: one host (network namespace, own address,
shaped link from the profile) per process slot ("coordinator", "peer3-s1", "trainer0", ...). A restarted
process keeps its slot, so it comes back on the same host, as it would on a real machine.

Starting a placement first removes the labs of owners that died (a SIGKILLed `swarm local` leaves its lab
behind) and any leftover lab of the same run id; close() removes the lab with every process still in it.
"""

from __future__ import annotations

import logging
import threading

from swarm.netlab.cleanup import cleanup_stale
from swarm.netlab.lab import Host, NetLab
from swarm.netlab.links import Profile

log = logging.getLogger(__name__)


class LabHosts:
    """One lab for a run; host(slot, role) creates the slot's host on first use."""

    def __init__(self, run_id: str, profile: Profile | str, seed: int = 0) -> None:
        removed = cleanup_stale()
        if removed:
            log.info("removed %d namespaces of network labs whose owner is gone", len(removed))
        self.lab = NetLab(run_id, profile, seed=seed).start()
        self._hosts: dict[str, Host] = {}
        self._lock = threading.Lock()

    def host(self, slot: str, role: str) -> Host:
        with self._lock:
            if slot not in self._hosts:
                self._hosts[slot] = self.lab.add_host(slot, role)
            return self._hosts[slot]

    def cut(self, slot: str, cut: bool = True) -> None:
        """Cut (or mend) the link of a slot's host: see NetLab.cut."""
        self.lab.cut(slot, cut)

    def hosts(self) -> dict[str, Host]:
        with self._lock:
            return dict(self._hosts)

    def close(self) -> None:
        self.lab.close()
