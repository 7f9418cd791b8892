"""NetLab: one lab of hosts, each in its own network namespace, linked to a switch namespace by a shaped veth.

It owns the lifecycle of a lab: start (remove leftovers of the same run, record the owner, create the switch),
add_host (namespace, veth pair, address, shaping, /etc/hosts), and close (remove all of it). Names and
addresses come from naming.py, qdiscs from tc.py, removal from cleanup.py.
"""

from __future__ import annotations

import atexit
import ipaddress
import json
import logging
import os
import re
import selectors
import socket
import subprocess
import sys
from dataclasses import dataclass

from swarm.netlab import cleanup, naming, tc
from swarm.netlab.links import LinkSpec, Profile, get_profile
from swarm.netlab.system import NetLabError, check_available, run

log = logging.getLogger(__name__)

FORWARDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "forwarder.py")
FORWARDER_TIMEOUT_S = 10.0
CLOSE_GRACE_S = 2.0
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


@dataclass
class Host:
    """One host of a lab: a network namespace with one interface on the lab's switch."""

    name: str
    netns: str
    ip: str
    link: LinkSpec
    role: str = "peer"
    index: int = 0
    ifname: str = ""
    inbound: bool = True  # False: behind NAT (others cannot open connections to it)

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run inside this host's namespace (`ip netns exec` sets the namespace, then execs argv: same pid)."""
        return ["ip", "netns", "exec", self.netns, *argv]


class NetLab:
    """A lab of network namespaces on a shaped switch, removed on close() (also by the next start() of the same
    run id, or cleanup_stale(), if this process dies first). Use as a context manager."""

    def __init__(self, run_id: str, profile: Profile | str = "lan", seed: int = 0, backend: str = "auto"):
        """backend: "auto" (kernel netem if available, else userspace), "kernel" (bridge + netem/tbf) or
        "userspace" (forwarder process + tbf); see the package docstring."""
        check_available()
        if backend not in ("auto", *tc.BACKENDS):
            raise NetLabError(f"unknown shaping backend {backend!r}: use auto, {' or '.join(tc.BACKENDS)}")
        try:
            self.profile = get_profile(profile)
        except ValueError as e:
            raise NetLabError(str(e)) from e
        self.run_id = run_id
        self.seed = seed
        self.key = naming.lab_key(run_id)
        self.subnet = naming.lab_subnet(self.key)
        self.switch_netns = naming.switch_netns(self.key)
        self.hosts: list[Host] = []
        self.backend = backend
        self._role_counts: dict[str, int] = {}
        self._aliases: dict[str, list[str]] = {}
        self._forwarder: subprocess.Popen | None = None
        self._netem = False
        self._started = False
        self._closed = False

    def __enter__(self) -> NetLab:
        return self if self._started else self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> NetLab:
        """Remove leftovers of this run id, then create the switch namespace (bridge or forwarder)."""
        if self._started:
            raise NetLabError(f"lab {self.run_id!r} is already started")
        state = cleanup.read_state(self.key)
        if cleanup.owner_alive(state) and state and state.get("owner_pid") != os.getpid():
            raise NetLabError(
                f"the network lab of run {state.get('run_id')!r} (namespaces {naming.lab_prefix(self.key)}*) "
                f"is in use by pid {state.get('owner_pid')}: stop it, or use another run id"
            )
        left = cleanup.remove_lab(self.key)
        if left:
            log.info("removed leftovers of an earlier lab of run %r: %s", self.run_id, ", ".join(left))
        self._started = True
        cleanup.write_state(self.key, self.run_id, subnet=str(self.subnet))
        atexit.register(self.close)
        try:
            self._create_switch()
        except BaseException:
            self.close()
            raise
        log.info(
            "network lab %s started: subnet %s, profile %s, backend %s",
            self.key,
            self.subnet,
            self.profile.name,
            self.backend,
        )
        return self

    def _create_switch(self) -> None:
        ns = self.switch_netns
        run(["ip", "netns", "add", ns])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        self._netem = tc.netem_available(ns)
        if self.backend == "auto":
            self.backend = tc.KERNEL if self._netem else tc.USERSPACE
        if self.backend == tc.KERNEL:
            bridge = naming.bridge_ifname(self.key)
            run(["ip", "-n", ns, "link", "add", bridge, "type", "bridge", "stp_state", "0"])
            run(["ip", "-n", ns, "link", "set", bridge, "up"])
        else:
            self._start_forwarder()

    def _start_forwarder(self) -> None:
        argv = ["ip", "netns", "exec", self.switch_netns, sys.executable, "-I", FORWARDER]
        with open(cleanup.forwarder_log_path(self.key), "w") as logfile:
            # Its own session: a Ctrl-C for the caller's process group leaves it to close(). It exits when its
            # stdin reaches EOF, i.e. when this process closes the lab or dies.
            self._forwarder = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logfile, text=True, start_new_session=True
            )

    def _forwarder_call(self, command: dict) -> str:
        """Send one command to the forwarder and return its reply (raises NetLabError on error or timeout)."""
        proc = self._forwarder
        if proc is None or proc.stdin is None or proc.stdout is None:
            raise NetLabError("the lab's forwarder is not running")
        try:
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        except OSError as e:
            raise NetLabError(f"the lab's forwarder died ({self._forwarder_log_tail()})") from e
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            reply = proc.stdout.readline().strip() if sel.select(FORWARDER_TIMEOUT_S) else ""
        if not reply.startswith("ok "):
            why = reply or f"no reply in {FORWARDER_TIMEOUT_S:.0f}s; log: {self._forwarder_log_tail()}"
            raise NetLabError(f"forwarder command {command.get('op')} failed: {why}")
        return reply[3:]

    def _forwarder_log_tail(self) -> str:
        try:
            with open(cleanup.forwarder_log_path(self.key)) as f:
                return " | ".join(f.read().strip().splitlines()[-5:]) or "empty"
        except OSError:
            return "no log"

    @property
    def has_netem(self) -> bool:
        """Whether the kernel offers the netem qdisc (known once started)."""
        return self._netem

    def forwarder_stats(self) -> dict:
        """Frames sent and dropped per switch port (userspace backend only; {} otherwise)."""
        if self._forwarder is None:
            return {}
        return json.loads(self._forwarder_call({"op": "stats"}).removeprefix("stats "))

    def add_host(self, name: str, role: str = "peer", link: LinkSpec | None = None, inbound: bool = True) -> Host:
        """Create host `name` (namespace, address, shaped link). link None: the profile's link for name/role.
        inbound=False puts it behind NAT: it connects out, but nobody can connect to it (userspace backend)."""
        if not self._started or self._closed:
            raise NetLabError(f"add_host({name!r}): the lab is not started (call start() or use `with NetLab(...)`)")
        if not _HOST_NAME.match(name):
            raise NetLabError(f"host name {name!r} must be letters, digits, '.', '_' or '-' (at most 63)")
        if any(h.name == name for h in self.hosts):
            raise NetLabError(f"host {name!r} already exists in lab {self.run_id!r}")
        index = len(self.hosts)
        if link is None:
            ordinal = self._role_counts.get(role, 0)
            link = self.profile.link_for(name, role, ordinal, self.seed)
        if self.backend == tc.KERNEL and link.impaired and not self._netem:
            raise NetLabError(
                f"host {name!r}: link {link.describe()} needs the netem qdisc, which this kernel lacks "
                "(CONFIG_NET_SCH_NETEM): use backend 'auto' or 'userspace'"
            )
        if not inbound and self.backend != tc.USERSPACE:
            raise NetLabError(f"host {name!r}: a host behind NAT (inbound=False) needs the userspace backend")
        self._role_counts[role] = self._role_counts.get(role, 0) + 1
        try:
            ip = naming.host_ip(self.key, index)
        except ValueError as e:
            raise NetLabError(str(e)) from e
        host = Host(
            name, naming.host_netns(self.key, index), str(ip), link, role, index, naming.host_ifname(self.key, index),
            inbound,
        )  # fmt: skip
        self.hosts.append(host)  # before creating anything: close() removes what exists of it
        self._create_host(host)
        self._write_hosts_files()
        log.info("host %s (%s) at %s in %s: %s", name, role, host.ip, host.netns, link.describe())
        return host

    def _create_host(self, host: Host) -> None:
        sw, ns = self.switch_netns, host.netns
        outer = naming.switch_ifname(self.key, host.index)
        run(["ip", "netns", "add", ns])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "link", "add", host.ifname, "netns", ns, "type", "veth", "peer", "name", outer, "netns", sw])
        run(["ip", "-n", ns, "addr", "add", f"{host.ip}/{self.subnet.prefixlen}", "dev", host.ifname])
        if self.backend == tc.KERNEL:
            run(["ip", "-n", sw, "link", "set", outer, "master", naming.bridge_ifname(self.key)])
        tc.shape(ns, host.ifname, host.link, self.backend)  # uploads: what the host sends
        tc.shape(sw, outer, host.link, self.backend)  # downloads: what the switch sends to the host
        run(["ip", "-n", sw, "link", "set", outer, "up"])
        run(["ip", "-n", ns, "link", "set", host.ifname, "up"])
        if self.backend == tc.USERSPACE:
            link = host.link
            self._forwarder_call(
                {
                    "op": "add",
                    "ifname": outer,
                    "delay_ms": link.delay_ms or 0,
                    "jitter_ms": link.jitter_ms or 0,
                    "loss_pct": link.loss_pct or 0,
                    "seed": self.seed,
                    "inbound": host.inbound,
                }
            )

    def _write_hosts_files(self) -> None:
        """/etc/netns/NS/hosts for every host: `ip netns exec` mounts it over /etc/hosts, so lab hosts resolve
        each other by name, and the machine's hostname resolves to the host's own address (`hostname -i` gives
        the lab IP, as in a container). Rewritten in place, so processes started earlier see later hosts too."""
        common = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback"]
        common += [" ".join([h.ip, h.name, *self._aliases.get(h.name, [])]) for h in self.hosts]
        machine = socket.gethostname()
        for h in self.hosts:
            os.makedirs(os.path.join(naming.ETC_NETNS, h.netns), exist_ok=True)
            with open(os.path.join(naming.ETC_NETNS, h.netns, "hosts"), "w") as f:
                f.write("\n".join([f"{h.ip} {machine}", *common]) + "\n")

    def cut(self, name: str, cut: bool = True) -> None:
        """Cut host `name`'s link (cut=False: mend it). A cut is a partition, as when a machine's uplink fails:
        frames to and from the host vanish, nobody gets a reset or an error, and connections that outlive the cut
        carry on. Userspace backend: the forwarder drops the frames; kernel backend: the switch end goes down."""
        host = self.host(name)
        if self.backend == tc.USERSPACE:
            self._forwarder_call({"op": "cut", "ifname": naming.switch_ifname(self.key, host.index), "cut": cut})
        else:
            outer = naming.switch_ifname(self.key, host.index)
            run(["ip", "-n", self.switch_netns, "link", "set", outer, "down" if cut else "up"])
        log.info("host %s: link %s", name, "cut" if cut else "mended")

    def set_aliases(self, name: str, aliases: list[str]) -> None:
        """More names for host `name` in every host's /etc/hosts (a container's service name, say)."""
        self.host(name)
        self._aliases[name] = list(aliases)
        self._write_hosts_files()

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} in lab {self.run_id!r}")

    def ip_of(self, name: str) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Address(self.host(name).ip)

    def close(self) -> None:
        """Remove every namespace, interface, process and file of this lab. Idempotent; never raises."""
        if self._closed or not self._started:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._stop_forwarder()
        except Exception:  # noqa: BLE001 - close() must not raise
            log.exception("stopping the forwarder of lab %s", self.key)
        removed = cleanup.remove_lab(self.key, grace_s=CLOSE_GRACE_S)
        log.info("network lab %s closed: removed %d namespaces", self.key, len(removed))

    def _stop_forwarder(self) -> None:
        proc, self._forwarder = self._forwarder, None
        if proc is None:
            return
        if proc.stdin:
            try:
                proc.stdin.close()
            except OSError:
                pass
        try:
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        if proc.stdout:
            proc.stdout.close()
        if proc.returncode not in (0, -9):
            log.warning("forwarder exited with %s: %s", proc.returncode, self._forwarder_log_tail())
