"""swarm.netlab profiles and link resolution: built-ins, files, overrides, the slow draw, tc commands."""

import json
import os

import pytest

from swarm.netlab import BUILTIN_PROFILES, LinkSpec, Profile, get_profile, load_profile_file
from swarm.netlab.links import PROFILES_DIR
from swarm.netlab.tc import KERNEL, USERSPACE, shape_commands


def links(profile: Profile, n: int, role: str = "peer", seed: int = 0) -> list[LinkSpec]:
    return [profile.link_for(f"{role}{i}", role, i, seed) for i in range(n)]


def test_lan_builtin():
    link = get_profile("lan").link_for("peer0", "peer", 0)
    assert link == LinkSpec(rate_mbit=1000, delay_ms=0.25)


def test_internet_delays_drawn_per_host_in_range_and_deterministic():
    profile = get_profile("internet")
    first = links(profile, 12)
    assert first == links(profile, 12)
    assert all(10 <= link.delay_ms <= 30 for link in first)
    assert len({link.delay_ms for link in first}) > 6
    assert all(link.rate_mbit == 100 and link.loss_pct == 0.1 and link.jitter_ms == 2 for link in first)
    assert [link.delay_ms for link in links(profile, 12, seed=1)] != [link.delay_ms for link in first]
    # A host's draw depends on its name and the seed, not on the order hosts are added in.
    assert profile.link_for("peer5", "peer", 0) == first[5]


@pytest.mark.parametrize("n", [3, 6, 9, 12])
@pytest.mark.parametrize("seed", [0, 1, 2, 7])
def test_mixed_third_of_peers_slow(n, seed):
    profile = get_profile("mixed")
    peers = links(profile, n, seed=seed)
    slow = [link for link in peers if link.rate_mbit == 20]
    assert len(slow) == n // 3
    assert all(link.delay_ms == 80 and link.jitter_ms == 10 for link in slow)
    assert all(link.rate_mbit == 100 and 10 <= link.delay_ms <= 30 for link in peers if link not in slow)
    assert peers == links(profile, n, seed=seed)


def test_mixed_phase_depends_on_seed_and_other_roles_never_slow():
    profile = get_profile("mixed")
    patterns = {tuple(profile.is_slow("peer", i, seed) for i in range(3)) for seed in range(20)}
    assert len(patterns) == 3  # each of the three peers of a group is the slow one for some seed
    assert not any(profile.is_slow("trainer", i, 0) or profile.is_slow("coordinator", i, 0) for i in range(9))


def test_mixed_uneven_counts_within_one():
    profile = get_profile("mixed")
    for seed in range(5):
        for n in range(1, 20):
            count = sum(profile.is_slow("peer", i, seed) for i in range(n))
            assert abs(count - n / 3) <= 1


def test_overrides_order_default_role_slow_host():
    profile = Profile.from_dict(
        {
            "default": {"rate_mbit": 100, "delay_ms": 10},
            "roles": {"trainer": {"rate_mbit": 50, "loss_pct": 1}, "peer": {"jitter_ms": 3}},
            "hosts": {"peer1": {"delay_ms": 200}, "trainer0": {"rate_mbit": 7}},
            "slow_fraction": 1.0,
            "slow": {"rate_mbit": 5},
        }
    )
    assert profile.link_for("trainer0", "trainer", 0) == LinkSpec(rate_mbit=7, delay_ms=10, loss_pct=1)
    assert profile.link_for("trainer1", "trainer", 1) == LinkSpec(rate_mbit=50, delay_ms=10, loss_pct=1)
    assert profile.link_for("peer0", "peer", 0) == LinkSpec(rate_mbit=5, delay_ms=10, jitter_ms=3)
    assert profile.link_for("peer1", "peer", 1) == LinkSpec(rate_mbit=5, delay_ms=200, jitter_ms=3)
    assert profile.link_for("coordinator", "coordinator", 0) == LinkSpec(rate_mbit=100, delay_ms=10)


def test_example_files_match_builtins():
    for name in BUILTIN_PROFILES:
        path = os.path.join(PROFILES_DIR, f"{name}.yaml")
        assert load_profile_file(path) == get_profile(name), path


def test_json_file_with_extends(tmp_path):
    path = tmp_path / "slowpeer.json"
    path.write_text(json.dumps({"extends": "lan", "hosts": {"peer3": {"rate_mbit": 5, "loss_pct": 1}}}))
    profile = get_profile(str(path))
    assert profile.name == "lan"
    assert profile.link_for("peer3", "peer", 3) == LinkSpec(rate_mbit=5, delay_ms=0.25, loss_pct=1)
    assert profile.link_for("peer2", "peer", 2) == LinkSpec(rate_mbit=1000, delay_ms=0.25)


def test_yaml_file_roles(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: p\ndefault: {rate_mbit: 10}\nroles:\n  trainer: {delay_ms: [5, 5]}\n")
    assert get_profile(str(path)).link_for("t", "trainer", 0) == LinkSpec(rate_mbit=10, delay_ms=5)


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"default": {"rate": 10}}, "unknown link field 'rate'"),
        ({"defaults": {}}, "unknown keys"),
        ({"default": {"rate_mbit": 0}}, "out of range"),
        ({"default": {"loss_pct": 100}}, "out of range"),
        ({"default": {"delay_ms": [30, 10]}}, "a range is [low, high]"),
        ({"default": {"delay_ms": "fast"}}, "must be a number"),
        ({"slow_fraction": 2}, "slow_fraction"),
        ({"extends": "moon"}, "extends unknown built-in"),
        ({"hosts": ["peer1"]}, "expected a mapping"),
    ],
)
def test_bad_profiles_say_what_is_wrong(doc, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Profile.from_dict(doc)


def test_unknown_profile_name():
    with pytest.raises(ValueError, match="unknown network profile 'wan'"):
        get_profile("wan")


def test_linkspec_merge_and_describe():
    base = LinkSpec(rate_mbit=100, delay_ms=20)
    assert base.merged(LinkSpec(delay_ms=5, loss_pct=1)) == LinkSpec(rate_mbit=100, delay_ms=5, loss_pct=1)
    assert not LinkSpec(rate_mbit=10).impaired and LinkSpec(loss_pct=1).impaired
    assert LinkSpec(rate_mbit=20, delay_ms=80, jitter_ms=10).describe() == "20Mbit 80ms ±10ms"
    assert LinkSpec().describe() == "unlimited"


def test_tc_commands_per_backend():
    link = LinkSpec(rate_mbit=10, delay_ms=20, jitter_ms=5, loss_pct=0.1)
    netem = shape_commands("ns", "if0", link, KERNEL)
    assert netem[0][:10] == ["tc", "-n", "ns", "qdisc", "add", "dev", "if0", "root", "handle", "1:"]
    assert " ".join(netem[0][10:]) == "netem limit 100000 delay 20ms 5ms distribution normal loss 0.1%"
    assert netem[1][7:10] == ["parent", "1:1", "handle"] and netem[1][11:14] == ["tbf", "rate", "10mbit"]
    userspace = shape_commands("ns", "if0", link, USERSPACE)
    assert len(userspace) == 1 and userspace[0][10:13] == ["tbf", "rate", "10mbit"]
    assert shape_commands("ns", "if0", LinkSpec(delay_ms=5), USERSPACE) == []
    assert shape_commands("ns", "if0", LinkSpec(rate_mbit=1000), KERNEL)[0][10] == "tbf"
