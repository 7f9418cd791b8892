"""swarm.netlab: a network lab of Linux network namespaces joined by shaped links (root only).

Each process of a local swarm can run in its own network namespace ("host"), with its own address and a link of
chosen bandwidth, delay, jitter and loss to the others:

    with NetLab("run-42", profile="internet", seed=0) as lab:
        coord = lab.add_host("coordinator", role="coordinator")     # 100.64.X.1, the first host
        peer = lab.add_host("peer0")                                 # 100.64.X.2, link from the profile
        subprocess.Popen(peer.wrap(["swarm", "peer", "--host", peer.ip, ...]))
    # every namespace, interface and process of the lab is gone here

Topology. The root namespace is left untouched: nothing of a lab is created in it. A "switch" namespace holds
the switch; host i's namespace holds one end of a veth pair (swnlKEYhI, address 100.64.X.(i+1)/24, loopback
up), whose other end (swnlKEYsI) is a port of the switch. There is no default route, no NAT, and nothing is
bridged to a real interface: a host reaches the other hosts of its lab and nothing else (connecting elsewhere
fails at once with "network unreachable"). `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts, where the
lab lists its hosts, so they also resolve each other by name, and the machine's hostname resolves to the host's
own lab address (`hostname -i` prints it, as in a container).

Shaping. Every figure of a host's LinkSpec applies to each direction of its link: the qdisc on the host end
shapes what the host sends, the one on the switch end what it receives. A path between two hosts therefore has
the sum of both ends' delays (one way) and the smaller of both rates. Two backends; "auto" takes kernel if the
kernel has sch_netem, else userspace:
  kernel     the switch is a Linux bridge; each link end gets netem (delay, normal jitter, loss) as root qdisc
             with a tbf child for the rate, or tbf alone for a rate-only link (which needs no netem).
  userspace  (no sch_netem, as on kernels built without it) the switch is forwarder.py, a small process in the
             switch namespace that forwards frames between the ports' AF_PACKET sockets after the links' delay
             and jitter (per-pair FIFO: no reordering), dropping with their loss; tbf on each end sets the rate.

Names (naming.py): KEY = sha1(run_id)[:6]; namespaces swnl-KEY-sw, swnl-KEY-h0, ...; interfaces swnlKEYhI,
swnlKEYsI, swnlKEYbr (<= 14 characters, only inside the lab's namespaces); subnet: the /24 number KEY mod 512 of
100.64.0.0/15 (naming.py says why not 198.18.0.0/15). State: /run/swarm-netlab/KEY.json records the owner's pid
and start time. start() first removes
what an earlier lab of the same run id left; cleanup_stale() removes every lab whose owner is dead (or, with a
prefix, every lab whose namespaces start with it, e.g. "swnl-"). Processes left in a lab's namespaces are killed.

Profiles (links.py): built-ins
  lan        1 Gbit/s, 0.25 ms per link end (0.5 ms one way between two hosts)
  internet   100 Mbit/s, per-end delay drawn per host from 10-30 ms (20-60 ms one way per path), 2 ms jitter,
             0.1 % loss
  mixed      "internet", except one peer in three: 20 Mbit/s, 80 ms, 10 ms jitter (about 100 ms one way)
or a YAML/JSON file (examples of the built-ins in swarm/netlab/profiles/):

    name: my-profile
    extends: internet                # optional: start from a built-in (roles, hosts, slow and default merged)
    default: {rate_mbit: 100, delay_ms: [10, 30], jitter_ms: 2, loss_pct: 0.1}   # [lo, hi]: drawn per host
    roles:                           # per-role overrides, by the role given to add_host
      coordinator: {rate_mbit: 1000, delay_ms: 1}
    hosts:                           # per-host overrides, by host name (applied last)
      peer3: {rate_mbit: 5, loss_pct: 1}
    slow_fraction: 0.333             # this fraction of the hosts of slow_roles take the "slow" link on top
    slow_roles: [peer]
    slow: {rate_mbit: 20, delay_ms: 80}

Fields: rate_mbit (> 0), delay_ms, jitter_ms (>= 0), loss_pct (0 <= x < 100); absent = not shaped. A host's link
is default, then roles[role], then slow (if drawn), then hosts[name]. Ranges are drawn from (seed, host name);
slow hosts are every 1/slow_fraction-th host of each slow role in order of add_host, with a seed-chosen phase.
"""

from swarm.netlab.cleanup import cleanup_stale
from swarm.netlab.lab import Host, NetLab
from swarm.netlab.links import BUILTIN_PROFILES, LinkSpec, Profile, get_profile, load_profile_file
from swarm.netlab.system import NetLabError, check_available

__all__ = [
    "BUILTIN_PROFILES",
    "Host",
    "LinkSpec",
    "NetLab",
    "NetLabError",
    "Profile",
    "check_available",
    "cleanup_stale",
    "get_profile",
    "load_profile_file",
]
