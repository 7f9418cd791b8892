"""The deployment files (no Docker engine here) stay in step with the CLI: every swarm command they
run parses with the real argument parser, and the Dockerfile installs what the package needs."""

import re
import shlex
import shutil
import subprocess
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


def _unit() -> dict[str, str]:
    """The unit's `Key=value` lines (continuations joined)."""
    text = (ROOT / "peers" / "swarm-peer.service").read_text().replace("\\\n", " ")
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def _example_env() -> dict[str, str]:
    lines = (ROOT / "peers" / "peer.env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def systemd_expand(command: str, env: dict[str, str]) -> list[str]:
    """ExecStart's words as systemd makes them: a word that is `$VAR` becomes the value split at whitespace
    (zero or more arguments); `${VAR}` becomes exactly one argument, whitespace and all."""
    argv = []
    for word in command.split():
        if re.fullmatch(r"\$\w+", word):
            argv += env.get(word[1:], "").split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env.get(m.group(1), ""), word))
    return argv


def test_systemd_unit_command_parses_with_the_example_settings():
    unit, env = _unit(), _example_env()
    argv = systemd_expand(unit["ExecStart"], env)
    assert argv[0] == "/opt/swarm/.venv/bin/swarm"
    args = make_parser().parse_args(argv[1:])
    assert args.command == "peer" and args.checkpoint_dir and args.identity_path
    assert args.initial_peers == env["SWARM_INITIAL_PEERS"].split() and len(args.initial_peers) == 2


def test_systemd_unit_lets_the_peer_drain_then_kills_the_rest():
    unit = _unit()
    assert unit["KillMode"] == "mixed"  # SIGTERM to the peer only; SIGKILL to what is left after the timeout
    assert unit["KillSignal"] == "SIGTERM" and int(unit["TimeoutStopSec"]) >= 30
    assert unit["Restart"] == "on-failure" and unit["EnvironmentFile"] == "/etc/swarm/peer.env"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path):
    """`systemd-analyze verify` finds nothing wrong (paths that exist only on a peer box replaced)."""
    text = (ROOT / "peers" / "swarm-peer.service").read_text()
    (tmp_path / "peer.env").write_text((ROOT / "peers" / "peer.env.example").read_text())
    replacements = {
        "/opt/swarm/.venv/bin/swarm": "/bin/true",
        "/etc/swarm/peer.env": str(tmp_path / "peer.env"),
        "WorkingDirectory=/opt/swarm": f"WorkingDirectory={tmp_path}",
        "User=swarm": "User=root",
    }
    for old, new in replacements.items():
        assert old in text
        text = text.replace(old, new)
    unit = tmp_path / "swarm-peer.service"
    unit.write_text(text)
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr


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
    assert schema["$schema"].startswith("https://json-schema.org/draft-07/")
    validator = jsonschema.Draft7Validator(schema)
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    validator.validate(compose)  # raises with the path of the first violation
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({**compose, "services": {"peer": {"comand": ["swarm", "peer"]}}})


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
