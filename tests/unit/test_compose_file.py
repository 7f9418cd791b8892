"""The compose runner reads a Compose file as docker compose does: interpolation (`$$`, `${VAR:-default}`,
`${VAR-default}`, `$VAR`, `${VAR:?message}`), merge keys, replicas, volumes, depends_on order."""

from pathlib import Path

import pytest

from swarm.core.errors import ConfigError
from swarm.netlab.compose_file import interpolate, load_compose

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("$$RUN_ID", "$RUN_ID"),  # left for the container's shell
        ('--announce-host "$$(hostname -i)"', '--announce-host "$(hostname -i)"'),
        ("${STEPS:-200}", "200"),
        ("${EMPTY:-x}", "x"),  # ":-": unset or empty
        ("${EMPTY-x}", ""),  # "-": only unset
        ("${UNSET-x}", "x"),
        ("$SET and ${SET}", "7 and 7"),
        ("${UNSET}", ""),
        ("a$$$$b", "a$$b"),
    ],
)
def test_interpolation(text, expected):
    assert interpolate(text, {"SET": "7", "EMPTY": ""}) == expected


def test_required_variable():
    with pytest.raises(ConfigError, match=r"\$\{RUN\} must be set: give a run"):
        interpolate("${RUN:?give a run}", {})
    assert interpolate("${RUN?x}", {"RUN": ""}) == ""


def test_repo_compose_file():
    project, volumes, services = load_compose(str(ROOT / "docker" / "compose.yaml"), {"STEPS": "5"})
    assert project == "swarm" and volumes == ["swarm-shared"]
    assert [s.name for s in services] == ["coordinator", "peer", "trainer"]  # depends_on order
    coordinator, peer, trainer = services
    assert peer.replicas == 6 and coordinator.replicas == 1
    assert peer.mounts == [("swarm-shared", "/shared")]  # from the x-swarm anchor, merged in
    assert peer.environment == {"OMP_NUM_THREADS": "1", "RUN_ID": "compose"}
    assert coordinator.argv[:2] == ["/bin/sh", "-c"] and coordinator.argv[2].startswith("exec swarm coordinator")
    assert '--run-id "$RUN_ID"' in peer.argv[2] and "\"$(hostname -i | cut -d' ' -f1)\"" in peer.argv[2]
    assert "--steps 5 " in trainer.argv[2]
    _, _, defaults = load_compose(str(ROOT / "docker" / "compose.yaml"), {})
    assert "--steps 200 " in defaults[2].argv[2]
