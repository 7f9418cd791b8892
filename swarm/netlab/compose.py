"""The compose runner: a Compose file run for real without Docker (`swarm compose-up`, docs/NETWORKS.md).

Each container (a service's replica) runs its command as a process on its own host of a network lab: its own
network namespace and address, a link from the lab's profile, /etc/hosts naming every container (and its
service), so `hostname -i` gives the container's address as in Docker. The service's environment is laid over
the runner's; a named volume is a folder of the run (WORKDIR/volumes/NAME) bind-mounted at its path in the
container's private mount namespace (the mount point is created if missing, and removed at the end if the
runner created it). Instead of the image, the repo's own code runs: `swarm` on the containers' PATH is this
Python's `python -m swarm.cli`, the same thing docker/Dockerfile installs.

Like `docker compose up --exit-code-from SERVICE`: containers start in depends_on order, the run ends when
that service's containers have exited (or any other container exits first), every container is then stopped
(SIGTERM, then SIGKILL of its process group), the lab removed, and the service's exit code returned.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarm.core.errors import ConfigError
from swarm.core.procs import ManagedProcess
from swarm.netlab.compose_file import Service, load_compose
from swarm.netlab.hosts import LabHosts

log = logging.getLogger(__name__)

SWARM_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
STOP_TIMEOUT_S = 30.0


@dataclass
class ComposeResult:
    exit_code: int
    exited: str  # the container whose exit ended the run
    lab: str  # the lab's key: its namespaces are named swnl-KEY-* (gone once the run returns)
    containers: dict[str, ManagedProcess] = field(default_factory=dict)


class ComposeRun:
    """One `compose up` of a file in a lab. Use as a context manager: everything is stopped and removed."""

    def __init__(self, path: str, workdir: str, profile: str = "lan", env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}
        self.project, self.volumes, self.services = load_compose(path, self.env)
        self.workdir = Path(workdir)
        self.containers: dict[str, ManagedProcess] = {}
        self._created_mountpoints: list[str] = []
        self._bin = self._write_shim()
        self.lab = LabHosts(f"compose-{self.project}-{os.getpid()}", profile)

    def _write_shim(self) -> Path:
        """`swarm` for the containers: this Python running this checkout's package."""
        bin_dir = self.workdir / "bin"
        bin_dir.mkdir(parents=True, exist_ok=True)
        shim = bin_dir / "swarm"
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m swarm.cli "$@"\n')
        shim.chmod(0o755)
        return bin_dir

    def _mount_wrapper(self, service: Service) -> list[str]:
        """argv prefix that bind-mounts the service's volumes (in the private mount namespace that
        `ip netns exec` gives each process), then execs the command."""
        if not service.mounts:
            return []
        steps = []
        for volume, target in service.mounts:
            source = self.workdir / "volumes" / volume
            source.mkdir(parents=True, exist_ok=True)
            if not os.path.exists(target):
                os.makedirs(target)
                self._created_mountpoints.append(target)
            steps.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
        return ["/bin/sh", "-c", " && ".join(steps) + ' && exec "$@"', "mount-volumes"]

    def _container_env(self, service: Service) -> dict[str, str]:
        path = f"{self._bin}{os.pathsep}{self.env.get('PATH', os.defpath)}"
        pythonpath = os.pathsep.join(filter(None, [SWARM_PACKAGE_ROOT, self.env.get("PYTHONPATH")]))
        return {**self.env, **service.environment, "PATH": path, "PYTHONPATH": pythonpath}

    def start(self) -> None:
        for service in self.services:
            for replica in range(1, service.replicas + 1):
                name = f"{self.project}-{service.name}-{replica}"
                host = self.lab.host(name, service.name)
                self.lab.lab.set_aliases(name, [service.name])
                cd = ["/bin/sh", "-c", f'cd {shlex.quote(service.working_dir)} && exec "$@"', "cd"]
                argv = host.wrap(self._mount_wrapper(service) + (cd if service.working_dir else []) + service.argv)
                log.info("starting %s at %s: %s", name, host.ip, " ".join(service.argv))
                env = self._container_env(service)
                self.containers[name] = ManagedProcess(name, argv, self.workdir / "logs" / f"{name}.log", env=env)

    def wait(self, exit_from: str, timeout_s: float) -> ComposeResult:
        """Until every container of `exit_from` has exited, or any other container exits first."""
        deadline = time.monotonic() + timeout_s
        target = [p for n, p in self.containers.items() if n.startswith(f"{self.project}-{exit_from}-")]
        if not target:
            raise ConfigError(f"--exit-code-from {exit_from}: no such service in the compose file")
        while time.monotonic() < deadline:
            others = [(n, p) for n, p in self.containers.items() if p not in target and not p.alive()]
            if others:
                name, proc = others[0]
                return ComposeResult(proc.proc.returncode or 1, name, self.lab.lab.key, self.containers)
            if all(not p.alive() for p in target):
                code = next((p.proc.returncode for p in target if p.proc.returncode), 0)
                return ComposeResult(code, target[0].name, self.lab.lab.key, self.containers)
            time.sleep(0.5)
        raise TimeoutError(f"{exit_from} did not finish within {timeout_s:.0f} s")

    def stop(self) -> None:
        procs = list(self.containers.values())
        threads = [threading.Thread(target=p.stop, kwargs={"timeout": STOP_TIMEOUT_S}) for p in procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.lab.close()
        for path in reversed(self._created_mountpoints):
            try:
                os.rmdir(path)
            except OSError:
                log.warning("left %s behind (not empty?)", path)

    def __enter__(self) -> ComposeRun:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def compose_up(path: str, exit_from: str, workdir: str | None = None, profile: str = "lan",
               env: dict[str, str] | None = None, timeout_s: float = 3600.0) -> ComposeResult:  # fmt: skip
    """Run the Compose file until `exit_from` exits; every container is stopped and the lab removed on return."""
    work = workdir or os.path.join("runs", f"compose-{time.strftime('%Y%m%d-%H%M%S')}")
    with ComposeRun(path, work, profile, env) as run:
        run.start()
        result = run.wait(exit_from, timeout_s)
    return result
