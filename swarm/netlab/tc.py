"""Traffic control on one end of a host link: the qdiscs that shape what leaves that interface.

Two backends, chosen once per lab:
  "kernel"     the kernel does everything: netem (delay, jitter, loss) as the root qdisc, with tbf as its child
               for the rate (`tc qdisc add dev X root handle 1: netem ...; tc qdisc add dev X parent 1:1 tbf ...`),
               or tbf alone when the link only has a rate (then no netem is needed).
  "userspace"  for kernels without sch_netem: tbf alone here; the lab's forwarder process adds delay, jitter and
               loss (see forwarder.py).
"""

from __future__ import annotations

import logging

from swarm.netlab.links import LinkSpec
from swarm.netlab.system import NetLabError, run

log = logging.getLogger(__name__)

KERNEL = "kernel"
USERSPACE = "userspace"
BACKENDS = (KERNEL, USERSPACE)
TBF_QUEUE_MS = 50  # at most this long a frame waits in a tbf queue before it is dropped
TBF_MIN_BURST = 80_000  # bytes: a GSO super-frame (64 KiB of payload + headers) passes whole
NETEM_LIMIT = 100_000  # packets netem may hold (its default, 1000, drops at 1 Gbit/s with 20 ms of delay)


def tbf_args(rate_mbit: float) -> list[str]:
    """tbf parameters for a rate: a burst of 4 ms worth (at least one GSO frame) and a 50 ms queue."""
    burst = max(int(rate_mbit * 1e6 / 8 * 0.004), TBF_MIN_BURST)
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", f"{TBF_QUEUE_MS}ms"]


def netem_args(link: LinkSpec) -> list[str]:
    args = ["netem", "limit", str(NETEM_LIMIT)]
    if link.delay_ms or link.jitter_ms:
        args += ["delay", f"{link.delay_ms or 0:g}ms"]
        if link.jitter_ms:
            args += [f"{link.jitter_ms:g}ms", "distribution", "normal"]
    if link.loss_pct:
        args += ["loss", f"{link.loss_pct:g}%"]
    return args


def shape_commands(netns: str, ifname: str, link: LinkSpec, backend: str) -> list[list[str]]:
    """The `tc` commands that shape what leaves `ifname` (in namespace `netns`) according to `link`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown shaping backend {backend!r} (known: {BACKENDS})")
    tc = ["tc", "-n", netns, "qdisc", "add", "dev", ifname]
    if backend == KERNEL and link.impaired:
        commands = [[*tc, "root", "handle", "1:", *netem_args(link)]]
        if link.rate_mbit:
            commands.append([*tc, "parent", "1:1", "handle", "10:", *tbf_args(link.rate_mbit)])
        return commands
    if link.rate_mbit:
        return [[*tc, "root", "handle", "1:", *tbf_args(link.rate_mbit)]]
    return []


def shape(netns: str, ifname: str, link: LinkSpec, backend: str) -> None:
    for argv in shape_commands(netns, ifname, link, backend):
        run(argv)


def netem_available(netns: str) -> bool:
    """Whether the kernel accepts a netem qdisc (tried on the loopback of `netns`, then removed)."""
    proc = run(["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
    if proc.returncode != 0:
        log.info("netem qdisc unavailable (%s): delay and loss by the userspace forwarder", proc.stderr.strip())
        return False
    run(["tc", "-n", netns, "qdisc", "del", "dev", "lo", "root"], check=False)
    return True


def require_tbf(netns: str) -> None:
    """Raise NetLabError if the kernel has no tbf qdisc (needed for any rate limit)."""
    proc = run(["tc", "-n", netns, "qdisc", "add", "dev", "lo", "root", *tbf_args(100)], check=False)
    if proc.returncode != 0:
        raise NetLabError(f"the kernel has no tbf qdisc (CONFIG_NET_SCH_TBF), needed for rate limits: {proc.stderr}")
    run(["tc", "-n", netns, "qdisc", "del", "dev", "lo", "root"], check=False)
