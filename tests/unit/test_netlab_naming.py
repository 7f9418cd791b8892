"""swarm.netlab names and addresses: short, recognizable, derived from the run id; the availability check."""

import ipaddress

import pytest

from swarm.netlab import NetLabError, check_available, naming, system

LAB_RANGE = ipaddress.IPv4Network("100.64.0.0/15")


@pytest.mark.parametrize("run_id", ["a", "demo", "x" * 200, "run with spaces/and:colons", "ünïcode"])
def test_names_short_and_parseable(run_id):
    key = naming.lab_key(run_id)
    assert len(key) == 6 and key == naming.lab_key(run_id)
    for index in (0, 9, 99, naming.MAX_HOSTS - 1):
        for name in (naming.host_ifname(key, index), naming.switch_ifname(key, index), naming.bridge_ifname(key)):
            assert len(name) <= 15 and name.startswith("swnl" + key)
        assert naming.parse_netns(naming.host_netns(key, index)) == key
    assert naming.parse_netns(naming.switch_netns(key)) == key
    assert naming.host_netns(key, 3).startswith(naming.lab_prefix(key))


def test_parse_netns_ignores_other_namespaces():
    for name in ("swnl-abc-h1", "swnl-abcdef-x1", "cni-1234", "swnl-ABCDEF-h1", "swnl-abcdef-h"):
        assert naming.parse_netns(name) is None


def test_subnets_inside_the_lab_range_and_spread():
    keys = [naming.lab_key(f"run-{i}") for i in range(200)]
    subnets = [naming.lab_subnet(key) for key in keys]
    assert all(s.subnet_of(LAB_RANGE) and s.prefixlen == 24 for s in subnets)
    assert len(set(subnets)) > 140  # 512 possible /24s
    assert naming.lab_subnet(keys[0]) == naming.lab_subnet(naming.lab_key("run-0"))


def test_host_addresses_first_is_dot_one():
    key = naming.lab_key("demo")
    subnet = naming.lab_subnet(key)
    assert naming.host_ip(key, 0) == subnet.network_address + 1
    ips = [naming.host_ip(key, i) for i in range(naming.MAX_HOSTS)]
    assert len(set(ips)) == naming.MAX_HOSTS and all(ip in subnet and ip != subnet.broadcast_address for ip in ips)
    with pytest.raises(ValueError, match="at most"):
        naming.host_ip(key, naming.MAX_HOSTS)


def test_interface_name_limit_enforced():
    with pytest.raises(ValueError, match="longer than 15"):
        naming.host_ifname("abcdef", 10000)


def test_not_root_message(monkeypatch):
    monkeypatch.setattr(system.os, "geteuid", lambda: 1000)
    with pytest.raises(NetLabError, match=r"^swarm local --netns needs root .*or without --netns$"):
        check_available()


def test_missing_ip_tool(monkeypatch):
    monkeypatch.setattr(system.os, "geteuid", lambda: 0)
    monkeypatch.setattr(system.shutil, "which", lambda tool: None)
    with pytest.raises(NetLabError, match="`ip` not found: install iproute2"):
        check_available()


def test_run_error_names_command_and_stderr():
    with pytest.raises(NetLabError, match=r"`ls /nonexistent-netlab` failed \(exit 2\): .*No such file"):
        system.run(["ls", "/nonexistent-netlab"])
    with pytest.raises(NetLabError, match="timed out"):
        system.run(["sleep", "5"], timeout=0.2)


def test_process_identity():
    import os

    me = os.getpid()
    start = system.process_start_time(me)
    assert start is not None and system.process_alive(me, start)
    assert not system.process_alive(me, start + 1)  # same pid, other process (pid reuse)
    assert not system.process_alive(2**22 + 12345, None)
