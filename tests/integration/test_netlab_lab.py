"""swarm.netlab on the real kernel (root only): reachability, delay, rate, loss, isolation, and removal (also
after the owner is SIGKILLed). Each host's processes are started with host.wrap(...), as the launcher will."""

import os
import signal
import subprocess
import sys
import time

import pytest

from swarm.netlab import LinkSpec, NetLab, NetLabError, check_available, cleanup_stale, naming
from swarm.netlab.cleanup import read_state


@pytest.fixture(autouse=True, scope="module")
def _labs_available():
    """These tests need root, `ip netns` and tc, as the test command has (CI runs as root)."""
    check_available()


pytestmark = pytest.mark.timeout(60)

PY = sys.executable
PORT = 5000
# Tiny network tools, run inside the hosts' namespaces with `python -c TOOLS MODE ...`.
TOOLS = r"""
import socket, sys, time
mode, args = sys.argv[1], sys.argv[2:]
if mode == "serve":  # serve IP: TCP echo ("e") or sink ("s" + size, replies "k" once all arrived); UDP counter
    tcp = socket.create_server((args[0], 5000), reuse_port=True)
    print("ready", flush=True)
    while True:
        c, _ = tcp.accept()
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if c.recv(1) == b"e":
            while d := c.recv(64):
                c.sendall(d)
        else:
            n, got = int(c.recv(16)), 0
            while got < n and (d := c.recv(1 << 20)):
                got += len(d)
            c.sendall(b"k")
        c.close()
elif mode == "rtt":  # rtt IP COUNT: print the median round trip (ms) of 1-byte messages
    c = socket.create_connection((args[0], 5000), timeout=5)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"e")
    rtts = []
    for _ in range(int(args[1])):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append((time.perf_counter() - t) * 1000)
    print(sorted(rtts)[len(rtts) // 2])
elif mode == "push":  # push IP SIZE: print the rate (MB/s) of sending SIZE bytes, until the sink's reply
    n = int(args[1])
    c = socket.create_connection((args[0], 5000), timeout=20)
    t = time.perf_counter()
    c.sendall(b"s" + str(n).encode().ljust(16)); c.sendall(bytes(n)); c.recv(1)
    print(n / (time.perf_counter() - t) / 1e6)
elif mode == "udp":  # udp IP COUNT: send COUNT datagrams to the UDP echo, print how many came back
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.3)
    for _ in range(50):  # first one echo, so that ARP (which the lossy link drops too) is resolved both ways
        s.sendto(b"warm", (args[0], 5001))
        try:
            s.recv(64); break
        except TimeoutError:
            pass
    for i in range(int(args[1])):
        s.sendto(b"m%d" % i, (args[0], 5001))
        time.sleep(0.001)
    got = 0
    try:
        while True:
            got += s.recv(64).startswith(b"m")
    except TimeoutError:
        print(got)
elif mode == "udpecho":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((args[0], 5001))
    print("ready", flush=True)
    while True:
        d, a = s.recvfrom(64); s.sendto(d, a)
elif mode == "partition":  # partition IP: one echo, then (told "cut") one unanswered, then (told "mended") its reply
    c = socket.create_connection((args[0], 5000), timeout=5)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"e"); c.sendall(b"1"); print("echo", c.recv(1).decode(), flush=True)
    assert sys.stdin.readline().strip() == "cut"
    c.sendall(b"2"); c.settimeout(2.0)
    try:
        print("answered", c.recv(1).decode(), flush=True)
    except TimeoutError:
        print("silent", flush=True)
    assert sys.stdin.readline().strip() == "mended"
    c.settimeout(20.0); t = time.monotonic()
    print("resumed", c.recv(1).decode(), round(time.monotonic() - t, 2), flush=True)
elif mode == "connect":  # connect IP PORT: print the errno name and the seconds it took to fail
    t = time.monotonic()
    try:
        socket.create_connection((args[0], int(args[1])), timeout=3)
        print("CONNECTED", 0)
    except OSError as e:
        print(__import__("errno").errorcode.get(e.errno, str(e)), time.monotonic() - t)
"""
# A lab owner that is about to be SIGKILLed: creates a lab of two hosts with a process in one, then sleeps.
OWNER = r"""
import subprocess, sys, time
from swarm.netlab import NetLab, LinkSpec
lab = NetLab(sys.argv[1], profile="internet").start()
a = lab.add_host("a")
lab.add_host("b", link=LinkSpec(rate_mbit=5))
subprocess.Popen(a.wrap(["sleep", "300"]))
print("ready", flush=True)
time.sleep(300)
"""


def tool(host, *args: str, timeout: float = 30) -> str:
    proc = subprocess.run(host.wrap([PY, "-c", TOOLS, *args]), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def start_server(host, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(host.wrap([PY, "-c", TOOLS, mode, "0.0.0.0"]), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def root_links() -> str:
    return subprocess.run(["ip", "link"], capture_output=True, text=True, timeout=10).stdout


@pytest.fixture(scope="module")
def lab():
    lab = NetLab(f"pytest-netlab-{os.getpid()}", profile="lan").start()
    try:
        lab.add_host("server")  # profile "lan": 1 Gbit/s, 0.25 ms
        lab.add_host("delayed", link=LinkSpec(delay_ms=50))
        lab.add_host("slow", link=LinkSpec(rate_mbit=10))
        lab.add_host("fast", link=LinkSpec(rate_mbit=100))
        lab.add_host("lossy", link=LinkSpec(loss_pct=20))
        servers = [start_server(lab.host("server"), "serve"), start_server(lab.host("server"), "udpecho")]
        yield lab
        for proc in servers:
            proc.kill()
            proc.wait(timeout=5)
    finally:
        lab.close()


def test_hosts_reach_each_other_by_ip_and_name(lab):
    server = lab.host("server")
    assert server.ip == str(lab.subnet.network_address + 1)
    for name in ("delayed", "fast", "slow"):
        assert float(tool(lab.host(name), "rtt", server.ip, "3")) > 0
    assert float(tool(lab.host("fast"), "rtt", "server", "3")) > 0  # /etc/netns/NS/hosts lists the lab's hosts
    own = subprocess.run(lab.host("slow").wrap(["hostname", "-i"]), capture_output=True, text=True, timeout=10)
    assert own.stdout.split()[0] == lab.host("slow").ip  # as in a container: the machine's name is the host's IP
    echo = start_server(lab.host("fast"), "serve")  # and the other way round, to a second host
    try:
        assert float(tool(server, "rtt", lab.host("fast").ip, "3")) > 0
    finally:
        echo.kill()
        echo.wait(timeout=5)


def test_delay(lab):
    server = lab.host("server").ip
    delayed = float(tool(lab.host("delayed"), "rtt", server, "5"))
    lan = float(tool(lab.host("fast"), "rtt", server, "20"))
    print(f"RTT via a 50 ms link: {delayed:.1f} ms; lan: {lan:.2f} ms")
    assert 100 <= delayed < 150
    assert lan < 10


def test_rate(lab):
    server = lab.host("server").ip
    slow = float(tool(lab.host("slow"), "push", server, str(2_000_000)))
    fast = float(tool(lab.host("fast"), "push", server, str(8_000_000)))
    print(f"10 Mbit/s link: {slow:.2f} MB/s; 100 Mbit/s link: {fast:.2f} MB/s")
    assert 0.6 <= slow <= 1.6
    assert fast >= 4 * slow


def test_loss_drops_some_not_all(lab):
    got = int(tool(lab.host("lossy"), "udp", lab.host("server").ip, "300"))
    print(f"20% loss each way: {got}/300 datagrams echoed")
    assert 0.4 * 300 <= got <= 0.85 * 300  # expected 0.8 * 0.8 = 64%
    assert int(tool(lab.host("fast"), "udp", lab.host("server").ip, "100")) == 100


def test_no_route_out(lab):
    host = lab.host("fast")
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    root_ips = [line.split()[3].split("/")[0] for line in out.splitlines() if " lo " not in line]
    for ip in ["8.8.8.8", "1.1.1.1", *root_ips]:
        name, seconds = tool(host, "connect", ip, "53").split()
        assert name == "ENETUNREACH" and float(seconds) < 0.5, (ip, name, seconds)
    routes = subprocess.run(host.wrap(["ip", "route"]), capture_output=True, text=True, timeout=10).stdout
    assert "default" not in routes


def test_close_removes_everything():
    lab = NetLab(f"pytest-netlab-close-{os.getpid()}").start()
    a = lab.add_host("a")
    lab.add_host("b", role="trainer")
    sleeper = subprocess.Popen(a.wrap(["sleep", "300"]))
    prefix = naming.lab_prefix(lab.key)
    assert netns_names().count(prefix) == 3
    assert read_state(lab.key)["owner_pid"] == os.getpid()
    lab.close()
    assert sleeper.wait(timeout=5) == -signal.SIGTERM  # processes left in the lab's namespaces are stopped
    assert prefix not in netns_names()
    assert f"swnl{lab.key}" not in root_links()
    assert not any(d.startswith(prefix) for d in os.listdir(naming.ETC_NETNS))
    assert read_state(lab.key) is None
    lab.close()  # idempotent


def start_doomed_owner(run_id: str) -> tuple[subprocess.Popen, list[int]]:
    """A child process that owns a lab (2 hosts, a process in one): return it and the pids in its namespaces."""
    owner = subprocess.Popen([PY, "-c", OWNER, run_id], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert owner.stdout.readline().strip() == "ready"
    key = naming.lab_key(run_id)
    pids = []
    for ns in (naming.switch_netns(key), naming.host_netns(key, 0)):
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
        pids += [int(p) for p in out.split()]
    return owner, pids


def sigkill(owner: subprocess.Popen) -> None:
    owner.send_signal(signal.SIGKILL)
    owner.wait(timeout=5)


def assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.05)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_sigkilled_owner_removed_by_cleanup_stale():
    run_id = f"pytest-netlab-crash-{os.getpid()}"
    key = naming.lab_key(run_id)
    owner, pids = start_doomed_owner(run_id)
    try:
        assert len(pids) >= 2  # the forwarder (or nothing with netem) and the sleeper
        assert key not in [ns[5:11] for ns in cleanup_stale()]  # a live owner's lab is kept
        with pytest.raises(NetLabError, match="in use by pid"):
            NetLab(run_id).start()
        sigkill(owner)
        assert naming.lab_prefix(key) in netns_names()  # nobody cleaned up...
        removed = cleanup_stale()
        assert {naming.host_netns(key, 0), naming.host_netns(key, 1), naming.switch_netns(key)} <= set(removed)
        assert naming.lab_prefix(key) not in netns_names()
        assert_gone(pids)
        assert read_state(key) is None
    finally:
        if owner.poll() is None:
            sigkill(owner)
        cleanup_stale(naming.lab_prefix(key))


def test_sigkilled_owner_removed_by_next_start_of_same_run():
    run_id = f"pytest-netlab-restart-{os.getpid()}"
    key = naming.lab_key(run_id)
    owner, pids = start_doomed_owner(run_id)
    sigkill(owner)
    with NetLab(run_id) as lab:
        assert netns_names().count(naming.lab_prefix(key)) == 1  # only the new switch
        assert_gone(pids)
        host = lab.add_host("again")
        assert host.netns == naming.host_netns(key, 0)
    assert naming.lab_prefix(key) not in netns_names()


def test_prefix_cleanup_removes_live_lab():
    lab = NetLab(f"pytest-netlab-prefix-{os.getpid()}").start()
    try:
        lab.add_host("a")
        assert len(cleanup_stale(naming.lab_prefix(lab.key))) == 2
        assert naming.lab_prefix(lab.key) not in netns_names()
    finally:
        lab.close()


def test_kernel_backend_bridge_and_tbf():
    """The kernel backend (Linux bridge, tc on both ends). Without sch_netem only rate-only links work there."""
    with NetLab(f"pytest-netlab-kernel-{os.getpid()}", backend="kernel") as lab:
        assert lab.backend == "kernel"
        server = lab.add_host("server", link=LinkSpec(rate_mbit=1000))
        slow = lab.add_host("slow", link=LinkSpec(rate_mbit=10))
        fast = lab.add_host("fast", link=LinkSpec(rate_mbit=100))
        echo = start_server(server, "serve")
        try:
            check_cut_and_mend(lab, server, fast)
            rtt = float(tool(fast, "rtt", server.ip, "10"))
            rate_slow = float(tool(slow, "push", server.ip, str(2_000_000)))
            rate_fast = float(tool(fast, "push", server.ip, str(8_000_000)))
            print(f"kernel backend: rtt {rtt:.2f} ms, 10 Mbit/s {rate_slow:.2f} MB/s, 100 Mbit/s {rate_fast:.2f} MB/s")
            assert rtt < 10 and 0.6 <= rate_slow <= 1.6 and rate_fast >= 4 * rate_slow
            if lab.has_netem:
                delayed = lab.add_host("delayed", link=LinkSpec(delay_ms=50))
                assert 100 <= float(tool(delayed, "rtt", server.ip, "5")) < 150
            else:
                with pytest.raises(NetLabError, match="needs the netem qdisc"):
                    lab.add_host("delayed", link=LinkSpec(delay_ms=50))
        finally:
            echo.kill()
            echo.wait(timeout=5)


def check_cut_and_mend(lab, server, client) -> None:
    """A cut link is a partition: an established connection's message gets no answer and no error while cut,
    and the same connection carries the answer once the link is mended."""
    proc = subprocess.Popen(
        client.wrap([PY, "-c", TOOLS, "partition", server.ip]), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().split() == ["echo", "1"]
        lab.cut(client.name)
        proc.stdin.write("cut\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["silent"]
        lab.cut(client.name, False)
        proc.stdin.write("mended\n")
        proc.stdin.flush()
        line = proc.stdout.readline().split()
        assert line[:2] == ["resumed", "2"], line
        print(f"{lab.backend}: the answer came {line[2]} s after the link was mended")
        assert proc.wait(timeout=10) == 0
    finally:
        proc.kill()
        proc.wait(timeout=5)


def test_cut_link_is_a_partition_that_mends(lab):
    check_cut_and_mend(lab, lab.host("server"), lab.host("fast"))
    # the other hosts were not cut off meanwhile, and the mended one works for new connections too
    assert float(tool(lab.host("fast"), "rtt", lab.host("server").ip, "3")) < 50


def test_host_behind_nat_connects_out_but_takes_no_connections():
    with NetLab(f"pytest-netlab-nat-{os.getpid()}") as lab:
        open_host = lab.add_host("open")
        natted = lab.add_host("natted", inbound=False)
        servers = [start_server(open_host, "serve"), start_server(natted, "serve")]
        try:
            assert float(tool(natted, "rtt", open_host.ip, "3")) > 0  # its own connections work, both ways
            name, seconds = tool(open_host, "connect", natted.ip, str(PORT)).split(maxsplit=1)
            assert name != "CONNECTED" and float(seconds.split()[-1]) >= 2.5, (name, seconds)  # SYN dropped: timeout
        finally:
            for proc in servers:
                proc.kill()
                proc.wait(timeout=5)
