"""The deployment files (no Docker engine here) stay in step with the CLI: every swarm command they
run parses with the real argument parser, and the Dockerfile installs what the package needs."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from swarm.cli import make_parser

ROOT = Path(__file__).resolve().parents[2]


def swarm_argv(command: str) -> list[str]:
    """The arguments after `swarm` in a shell command line, with shell substitutions neutralized."""
    command = command.replace("$$", "$")
    command = re.sub(r'"\$\([^)]*\)"', "10.0.0.2", command)  # $(hostname -i ...)
    command = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", command)  # ${VAR:-default}
    command = re.sub(r'"?\$\{?(\w+)\}?"?', r"VALUE_\1", command)
    tokens = shlex.split(command)
    return tokens[tokens.index("swarm") + 1 :]


def test_compose_commands_parse():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    parser = make_parser()
    seen = set()
    for name, service in compose["services"].items():
        (command,) = service["command"]
        argv = swarm_argv(command)
        args = parser.parse_args(argv)
        seen.add(args.command)
        assert args.command == name
    assert seen == {"coordinator", "peer", "trainer"}
    assert compose["services"]["peer"]["deploy"]["replicas"] >= 2


def test_systemd_unit_command_parses_with_the_example_settings():
    unit = (ROOT / "peers" / "swarm-peer.service").read_text().replace("\\\n", " ")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))[len("ExecStart=") :]
    env = dict(
        line.split("=", 1)
        for line in (ROOT / "peers" / "peer.env.example").read_text().splitlines()
        if line and not line.startswith("#")
    )
    command = re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], exec_start)
    argv = swarm_argv(command.replace("/opt/swarm/.venv/bin/swarm", "swarm"))
    args = make_parser().parse_args(argv)
    assert args.command == "peer" and args.checkpoint_dir


def test_dockerfile_installs_torch_first_and_the_project():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    torch_at = text.index('"torch==${TORCH_VERSION}"')
    project_at = text.index('pip install ".[')
    assert torch_at < project_at, "torch's CPU wheel must be installed before the project"
    for path in ("pyproject.toml", "setup.py", "proto", "swarm"):
        assert path in text
    assert 'ENTRYPOINT ["swarm"]' in text


# The Compose Specification's JSON schema, shipped with the repo (tests/data/README.md says where it is from).
COMPOSE_SCHEMA = ROOT / "tests" / "data" / "compose-spec.json"


def test_compose_file_follows_the_compose_specification():
    import json

    import jsonschema

    schema = json.loads(COMPOSE_SCHEMA.read_text())
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    jsonschema.validate(compose, schema)  # raises with the path of the first violation
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**compose, "services": {"peer": {"comand": ["swarm", "peer"]}}}, schema)


def _bootstrap_installs() -> tuple[str, str]:
    """(torch version, project extras) that scripts/bootstrap.sh installs, in that order."""
    text = (ROOT / "scripts" / "bootstrap.sh").read_text()
    torch_at, torch_version = text.index('"torch=='), re.search(r'"torch==([\d.]+)"', text).group(1)
    project = re.search(r'-e "\.\[([\w,]+)\]"', text)
    assert torch_at < project.start(), "bootstrap.sh installs torch before the project"
    return torch_version, project.group(1)


def test_dockerfile_installs_what_bootstrap_installs():
    """The image holds what README.md installs: torch 2.13.0's CPU build first, then the project, same extras."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))
    torch_version, extras = _bootstrap_installs()
    assert args["TORCH_VERSION"] == torch_version == "2.13.0"
    assert args["TORCH_INDEX"].endswith("/cpu")
    assert args["EXTRAS"] == extras
    runs = [line for line in text.splitlines() if line.startswith("RUN ")]
    assert "torch==${TORCH_VERSION}" in runs[0] and "${TORCH_INDEX}" in runs[0]
    assert 'pip install ".[${EXTRAS}]"' in runs[1] and "swarm.wire.codegen" in runs[1]
    assert "swarm.wire.codegen" in (ROOT / "scripts" / "bootstrap.sh").read_text()
