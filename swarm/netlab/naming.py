"""Names and addresses of a lab, all derived from its run id.

A lab's key is the first 6 hex digits of sha1(run_id). From it:
  namespaces   swnl-KEY-sw (the switch), swnl-KEY-h0, swnl-KEY-h1, ... (the hosts, in the order added)
  interfaces   swnlKEYhI (host end of host I's veth), swnlKEYsI (switch end), swnlKEYbr (bridge); at most
               4 + 6 + 1 + 3 = 14 characters for I < 1000, under Linux's 15. They only ever exist inside the
               lab's namespaces, never in the root namespace.
  subnet       100.64.0.0/15 cut into 512 /24 subnets; the lab takes the one numbered KEY mod 512, and host I
               gets .I+1 (so the first host, the coordinator, is .1). The addresses exist only inside the lab's
               namespaces, which have no route out. Why not 198.18.0.0/15 (RFC 2544's benchmarking range):
               libp2p counts it "unroutable" and its DHT drops such addresses, so hivemind peers in a lab could
               not find each other (the stage all-reduce failed with "routing: not found"); 100.64.0.0/10
               (RFC 6598, shared address space) is private to libp2p, as a LAN is.
  state        /run/swarm-netlab/KEY.json (owner pid, run id, namespaces), /etc/netns/swnl-KEY-*/hosts.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re

NS_PREFIX = "swnl-"
IF_PREFIX = "swnl"
STATE_DIR = "/run/swarm-netlab"
ETC_NETNS = "/etc/netns"
LAB_RANGE = ipaddress.IPv4Network("100.64.0.0/15")
SUBNET_PREFIXLEN = 24
MAX_HOSTS = 250
IFNAMSIZ = 15
_NS_RE = re.compile(r"^swnl-([0-9a-f]{6})-(sw|h\d+)$")


def lab_key(run_id: str) -> str:
    """6 hex digits that name every namespace, interface and file of the lab of this run."""
    if not run_id:
        raise ValueError("run_id must not be empty")
    return hashlib.sha1(run_id.encode()).hexdigest()[:6]


def lab_prefix(key: str) -> str:
    """The prefix shared by the names of all namespaces of one lab (for cleanup_stale(prefix=...))."""
    return f"{NS_PREFIX}{key}-"


def switch_netns(key: str) -> str:
    return f"{NS_PREFIX}{key}-sw"


def host_netns(key: str, index: int) -> str:
    return f"{NS_PREFIX}{key}-h{index}"


def host_ifname(key: str, index: int) -> str:
    """The host end of host `index`'s veth pair, inside the host's namespace."""
    return _ifname(f"{IF_PREFIX}{key}h{index}")


def switch_ifname(key: str, index: int) -> str:
    """The switch end of host `index`'s veth pair, inside the switch namespace."""
    return _ifname(f"{IF_PREFIX}{key}s{index}")


def bridge_ifname(key: str) -> str:
    return _ifname(f"{IF_PREFIX}{key}br")


def _ifname(name: str) -> str:
    if len(name) > IFNAMSIZ:
        raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ} characters")
    return name


def parse_netns(name: str) -> str | None:
    """The lab key of a namespace name of ours, or None for any other namespace."""
    m = _NS_RE.match(name)
    return m.group(1) if m else None


def lab_subnet(key: str) -> ipaddress.IPv4Network:
    """The /24 of LAB_RANGE (100.64.0.0/15) used by this lab."""
    count = 2 ** (SUBNET_PREFIXLEN - LAB_RANGE.prefixlen)
    index = int(key, 16) % count
    base = int(LAB_RANGE.network_address) + index * 2 ** (32 - SUBNET_PREFIXLEN)
    return ipaddress.IPv4Network((base, SUBNET_PREFIXLEN))


def host_ip(key: str, index: int) -> ipaddress.IPv4Address:
    if not 0 <= index < MAX_HOSTS:
        raise ValueError(f"a lab holds at most {MAX_HOSTS} hosts (host index {index})")
    return lab_subnet(key).network_address + index + 1
