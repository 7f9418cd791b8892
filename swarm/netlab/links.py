"""Link specifications and profiles: which bandwidth, delay, jitter and loss each host's link gets.

A LinkSpec describes one host's link to the lab's switch. Every figure applies to each direction of that link
separately: a host with rate_mbit=10 uploads and downloads at 10 Mbit/s at most, and delay_ms=20 adds 20 ms to
every frame it sends and to every frame it receives. A path between two hosts crosses two links, so its one-way
delay is the sum of both ends' delays and its rate the smaller of both rates.

A profile (built-in name, or a YAML/JSON file; the format is in the package docstring) gives each host its
LinkSpec from its name and role. Values drawn from ranges, and the choice of slow hosts, depend only on the
seed, the host's name and its rank among the hosts of its role, never on wall-clock randomness.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
from dataclasses import dataclass, field, fields, replace
from typing import Any

log = logging.getLogger(__name__)

FIELDS = ("rate_mbit", "delay_ms", "jitter_ms", "loss_pct")
PROFILE_KEYS = {"name", "extends", "default", "roles", "hosts", "slow", "slow_fraction", "slow_roles"}
PROFILES_DIR = os.path.join(os.path.dirname(__file__), "profiles")

Value = float | tuple[float, float]
Rule = dict[str, Value]


@dataclass(frozen=True)
class LinkSpec:
    """One host link's shaping; None leaves that aspect unshaped."""

    rate_mbit: float | None = None
    delay_ms: float | None = None
    jitter_ms: float | None = None
    loss_pct: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{f.name} must be a number, got {value!r}")
            if value < 0 or (f.name == "rate_mbit" and value == 0) or (f.name == "loss_pct" and value >= 100):
                raise ValueError(f"{f.name}={value} is out of range")

    def merged(self, other: LinkSpec) -> LinkSpec:
        """This spec with every field that `other` sets replaced by other's value."""
        return replace(self, **{k: v for k, v in other.as_dict().items() if v is not None})

    def as_dict(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in FIELDS}

    @property
    def impaired(self) -> bool:
        """Whether the link delays or drops frames (as opposed to only limiting the rate)."""
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    def describe(self) -> str:
        parts = [
            f"{self.rate_mbit:g}Mbit" if self.rate_mbit else "unlimited",
            f"{self.delay_ms:g}ms" if self.delay_ms else "",
            f"±{self.jitter_ms:g}ms" if self.jitter_ms else "",
            f"loss {self.loss_pct:g}%" if self.loss_pct else "",
        ]
        return " ".join(p for p in parts if p)


@dataclass(frozen=True)
class Profile:
    """Rules that give each host its link: default, then role, then slow draw, then per-host overrides."""

    name: str
    default: Rule = field(default_factory=dict)
    roles: dict[str, Rule] = field(default_factory=dict)
    hosts: dict[str, Rule] = field(default_factory=dict)
    slow: Rule = field(default_factory=dict)
    slow_fraction: float = 0.0
    slow_roles: tuple[str, ...] = ("peer",)

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str = "custom") -> Profile:
        """Parse a profile document (see the package docstring); ValueError says what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"profile {name}: expected a mapping at the top level, got {type(data).__name__}")
        unknown = set(data) - PROFILE_KEYS
        if unknown:
            raise ValueError(f"profile {name}: unknown keys {sorted(unknown)} (known: {sorted(PROFILE_KEYS)})")
        if "extends" in data:
            base = BUILTIN_PROFILES.get(data["extends"])
            if base is None:
                raise ValueError(f"profile {name}: extends unknown built-in {data['extends']!r}")
            data = _extend(base, data)
        fraction = float(data.get("slow_fraction", 0.0))
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"profile {name}: slow_fraction must be in [0, 1], got {fraction}")
        slow_roles = data.get("slow_roles", ["peer"])
        if not isinstance(slow_roles, list) or not all(isinstance(r, str) for r in slow_roles):
            raise ValueError(f"profile {name}: slow_roles must be a list of role names")
        return cls(
            name=str(data.get("name", name)),
            default=_parse_rule(data.get("default", {}), f"{name}.default"),
            roles=_parse_rules(data.get("roles", {}), f"{name}.roles"),
            hosts=_parse_rules(data.get("hosts", {}), f"{name}.hosts"),
            slow=_parse_rule(data.get("slow", {}), f"{name}.slow"),
            slow_fraction=fraction,
            slow_roles=tuple(slow_roles),
        )

    def is_slow(self, role: str, ordinal: int, seed: int) -> bool:
        """Whether the `ordinal`-th host (0-based) of this role is slow: exactly every 1/fraction-th one,
        with a seed-chosen phase, so any n hosts of the role hold round(n * fraction) +- 1 slow ones."""
        f = self.slow_fraction
        if f <= 0 or not self.slow or role not in self.slow_roles:
            return False
        if f >= 1:
            return True
        phase = random.Random(f"{seed}/slow/{role}").randrange(math.ceil(1 / f))
        x = ordinal + phase
        return math.floor((x + 1) * f + 1e-9) > math.floor(x * f + 1e-9)

    def link_for(self, name: str, role: str, ordinal: int, seed: int = 0) -> LinkSpec:
        """The link of host `name`, the `ordinal`-th (0-based) host of `role` added to the lab."""
        rules = [self.default, self.roles.get(role, {})]
        if self.is_slow(role, ordinal, seed):
            rules.append(self.slow)
        rules.append(self.hosts.get(name, {}))
        link = LinkSpec()
        for rule in rules:
            link = link.merged(_draw(rule, seed, name))
        return link


def _draw(rule: Rule, seed: int, host: str) -> LinkSpec:
    """A rule's values, ranges drawn uniformly and deterministically from (seed, host, field)."""
    values: dict[str, float] = {}
    for key, value in rule.items():
        if isinstance(value, tuple):
            values[key] = round(random.Random(f"{seed}/{host}/{key}").uniform(*value), 3)
        else:
            values[key] = value
    return LinkSpec(**values)


def _parse_rule(data: Any, where: str) -> Rule:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of {FIELDS}, got {data!r}")
    rule: Rule = {}
    for key, value in data.items():
        if key not in FIELDS:
            raise ValueError(f"{where}: unknown link field {key!r} (known: {', '.join(FIELDS)})")
        if isinstance(value, list | tuple):
            if len(value) != 2 or value[0] > value[1]:
                raise ValueError(f"{where}.{key}: a range is [low, high], got {value!r}")
            rule[key] = (float(value[0]), float(value[1]))
            LinkSpec(**{key: rule[key][0]}), LinkSpec(**{key: rule[key][1]})  # validate both ends
        elif value is not None:
            LinkSpec(**{key: value})  # validates
            rule[key] = float(value)
    return rule


def _parse_rules(data: Any, where: str) -> dict[str, Rule]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of name -> link, got {data!r}")
    return {str(k): _parse_rule(v, f"{where}.{k}") for k, v in data.items()}


def _extend(base: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
    """A built-in profile document with the keys of `data` laid over it (roles and hosts merged)."""
    out = {**base, **{k: v for k, v in data.items() if k != "extends"}}
    for key in ("default", "roles", "hosts", "slow"):
        if key in base and key in data:
            out[key] = {**base[key], **data[key]}
    return out


BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "lan": {"name": "lan", "default": {"rate_mbit": 1000, "delay_ms": 0.25}},
    "internet": {
        "name": "internet",
        "default": {"rate_mbit": 100, "delay_ms": [10, 30], "jitter_ms": 2, "loss_pct": 0.1},
    },
    "mixed": {
        "name": "mixed",
        "default": {"rate_mbit": 100, "delay_ms": [10, 30], "jitter_ms": 2, "loss_pct": 0.1},
        "slow_fraction": 1 / 3,
        "slow_roles": ["peer"],
        "slow": {"rate_mbit": 20, "delay_ms": 80, "jitter_ms": 10},
    },
}


def load_profile_file(path: str) -> Profile:
    """Read a profile from a .json, .yaml or .yml file."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"cannot read profile file {path}: {e}") from e
    name = os.path.splitext(os.path.basename(path))[0]
    if path.endswith(".json"):
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as e:
            raise ValueError(f"profile {path}: reading YAML needs pyyaml (pip install pyyaml), or use JSON") from e
        data = yaml.safe_load(text)
    return Profile.from_dict(data or {}, name=name)


def get_profile(profile: Profile | str) -> Profile:
    """A Profile from itself, a built-in name ("lan", "internet", "mixed") or a file path."""
    if isinstance(profile, Profile):
        return profile
    if profile in BUILTIN_PROFILES:
        return Profile.from_dict(BUILTIN_PROFILES[profile], name=profile)
    if os.path.exists(profile):
        return load_profile_file(profile)
    raise ValueError(f"unknown network profile {profile!r}: use one of {sorted(BUILTIN_PROFILES)} or a file path")
