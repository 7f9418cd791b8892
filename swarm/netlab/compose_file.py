"""Reading a Compose file as `docker compose` does, for the compose runner (compose.py): YAML with anchors and
merge keys, variable interpolation, and each service's command, environment, volumes and replicas.

Interpolation follows the Compose Specification: in every string value, `$$` is a literal `$` (left for the
container's shell), `${VAR}` and `$VAR` are the variable's value (empty if unset), `${VAR:-default}` the
default when VAR is unset or empty, `${VAR-default}` only when unset, `${VAR:?message}` / `${VAR?message}` an
error when unset (or empty). Variables come from the runner's environment, then a `.env` file beside the
Compose file (the environment wins, as in Compose).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import yaml

from swarm.core.errors import ConfigError

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)
# keys of a service that the runner understands; others (image, build, networks, ...) do not change what runs
IGNORED_KEYS = {"build", "image", "networks", "ports", "expose", "restart", "labels", "container_name", "init"}
SUPPORTED_KEYS = {"command", "entrypoint", "environment", "volumes", "deploy", "depends_on", "working_dir"}


def interpolate(text: str, env: dict[str, str]) -> str:
    def replace(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        value, op, arg = env.get(name), m.group("op"), m.group("arg") or ""
        unset_or_empty = value is None or (value == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                raise ConfigError(f"${{{name}}} must be set: {arg or 'required by the compose file'}")
            return value
        return value or ""

    return _VAR.sub(replace, text)


def interpolate_all(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_all(v, env) for v in node]
    if isinstance(node, dict):
        return {k: interpolate_all(v, env) for k, v in node.items()}
    return node


def read_dotenv(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                out[key.strip()] = value.strip().strip("'\"")
    return out


@dataclass
class Service:
    """One service, ready to run: argv (entrypoint + command), environment, volume mounts, replicas."""

    name: str
    argv: list[str]
    environment: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str]] = field(default_factory=list)  # (named volume, path in the container)
    replicas: int = 1
    depends_on: list[str] = field(default_factory=list)
    working_dir: str | None = None


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def _environment(value: Any) -> dict[str, str]:
    if isinstance(value, list):
        pairs = [item.split("=", 1) if "=" in item else [item, os.environ.get(item, "")] for item in value]
        return {k: v for k, v in pairs}
    return {str(k): "" if v is None else str(v) for k, v in (value or {}).items()}


def _mounts(name: str, volumes: list, declared: set[str]) -> list[tuple[str, str]]:
    mounts = []
    for item in volumes or []:
        if isinstance(item, dict):
            source, target, kind = item.get("source"), item.get("target"), item.get("type", "volume")
        else:
            source, _, rest = str(item).partition(":")
            target, kind = rest.split(":")[0], "volume"
        if kind != "volume" or source not in declared or not target:
            raise ConfigError(f"service {name}: only named volumes declared under `volumes:` are supported, got {item}")
        mounts.append((source, target))
    return mounts


def _service(name: str, spec: dict, declared: set[str], default_entrypoint: list[str]) -> Service:
    unknown = set(spec) - SUPPORTED_KEYS - IGNORED_KEYS
    if unknown:
        raise ConfigError(f"service {name}: the compose runner does not support {sorted(unknown)}")
    entrypoint = _as_list(spec["entrypoint"]) if "entrypoint" in spec else list(default_entrypoint)
    depends = spec.get("depends_on") or []
    replicas = int(((spec.get("deploy") or {}).get("replicas")) or 1)
    return Service(
        name, entrypoint + _as_list(spec.get("command")), _environment(spec.get("environment")),
        _mounts(name, spec.get("volumes"), declared), replicas,
        list(depends) if isinstance(depends, list) else list(depends.keys()), spec.get("working_dir"),
    )  # fmt: skip


def load_compose(path: str, env: dict[str, str] | None = None, entrypoint: list[str] = ("swarm",)) -> tuple:
    """(project name, declared volume names, services in start order) of a Compose file. `entrypoint` stands for
    the image's ENTRYPOINT (docker/Dockerfile: ["swarm"]) where a service sets none."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read compose file {path}: {e}") from None
    variables = {**read_dotenv(os.path.join(os.path.dirname(os.path.abspath(path)), ".env")), **(env or os.environ)}
    doc = interpolate_all({k: v for k, v in raw.items() if not str(k).startswith("x-")}, variables)
    project = str(doc.get("name") or os.path.basename(os.path.dirname(os.path.abspath(path))))
    declared = set((doc.get("volumes") or {}).keys())
    services = {n: _service(n, s or {}, declared, list(entrypoint)) for n, s in (doc.get("services") or {}).items()}
    return project, sorted(declared), _start_order(services)


def _start_order(services: dict[str, Service]) -> list[Service]:
    order: list[Service] = []
    visiting: set[str] = set()

    def visit(name: str) -> None:
        if any(s.name == name for s in order):
            return
        if name in visiting or name not in services:
            raise ConfigError(f"depends_on: {name!r} is unknown or part of a cycle")
        visiting.add(name)
        for dep in services[name].depends_on:
            visit(dep)
        order.append(services[name])

    for name in services:
        visit(name)
    return order
