"""One source of truth for settings: the config dataclasses of each role declare every field with its
default and help text (`setting`), and the command line is generated from them (`add_settings`,
`from_args`). Shared timing constants live here too, each named with its unit.

A field named `*_s` is in seconds; its command-line flag drops the suffix (`drain_timeout_s` ->
`--drain-timeout`) and its help says "seconds".
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Final

# A peer that has not answered an Info poll for this long is dead to wiring, placement, the
# status view and the simulator (its DHT record may live longer: it expires after the record TTL).
LIVENESS_WINDOW_S: Final[float] = 4.0
# How often a peer polls its stage-mates' Info (step, samples held, fingerprint), and a trainer
# every peer's (at most: swarm.policy.polling stretches it with the pollers). Not faster: the
# moments that matter are pushed, not polled (a backward accumulated and a mate's freeze wake the
# step decision; a trainer held back by the pacing long-polls for the step), and at 0.1 s the polls
# of a 3x4 local swarm (about 600 a second) took a quarter of its 2 cores: 28 samples/s against 41
# at 0.25 s, with the 3x2 swarm unchanged (scripts/bench_overload.py, docs/BENCHMARKS.md).
INFO_PERIOD_S: Final[float] = 0.25
# Deadline of one Info poll.
INFO_TIMEOUT_S: Final[float] = 2.0
# Deadline of any one DHT get or store: a call on a dead DHT process never hangs a thread.
DHT_TIMEOUT_S: Final[float] = 15.0
# DHT stage records are re-read this often by every view.
DHT_REFRESH_S: Final[float] = 2.0

_MISSING = dataclasses.MISSING


def setting(
    default: Any = _MISSING,
    help: str = "",  # noqa: A002 - argparse's name
    *,
    factory: typing.Callable[[], Any] | None = None,
    flag: str | None = None,
    choices: typing.Sequence[Any] | None = None,
    metavar: str | None = None,
    parse: typing.Callable[[str], Any] | None = None,
    cli: bool = True,
) -> Any:
    """A dataclass field with its help text. `parse` turns the option's text into the value (default:
    the field's type); `cli=False` keeps it off the command line (set by code)."""
    metadata = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "parse": parse, "cli": cli}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.removesuffix("_s").replace("_", "-")


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the scalar or list type, whether None is allowed) of a field's annotation."""
    optional = False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0]
    return hint, optional


def default_of(cls: type, name: str) -> Any:
    """A dataclass field's default, for options that are not generated (e.g. set in two places)."""
    return _default_of(next(f for f in dataclasses.fields(cls) if f.name == name))


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return field.default_factory()
    return _MISSING


def cli_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", False)]


def add_settings(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: typing.Collection[str] = (),
    overrides_only: bool = False,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Add one option per `setting` field of `cls`: type, default, choices and help from the field.

    `overrides_only`: every option defaults to None ("not given"), for options that override values
    from elsewhere (a config file); the help still shows the dataclass default. `defaults` replaces a
    field's default on this command line only (e.g. `swarm local` runs one torch thread per process).
    """
    hints = typing.get_type_hints(cls)
    for field in cli_fields(cls):
        if field.name in skip:
            continue
        hint, optional = _base_type(hints[field.name])
        default = (defaults or {}).get(field.name, _default_of(field))
        shown = _default_of(field) if overrides_only or default is None else default
        text = field.metadata["help"]
        if field.name.endswith("_s") and "second" not in text:
            text += ", in seconds"
        if hint is bool and shown is not _MISSING and shown is not None:
            text += f" (default {'on' if shown else 'off'})"
        elif shown not in (None, _MISSING, "") and not (isinstance(shown, list) and not shown):
            text += f" (default {shown})"
        text = text.replace("%", "%%")
        kwargs: dict[str, Any] = {"dest": field.name, "help": text}
        if field.metadata.get("metavar"):
            kwargs["metavar"] = field.metadata["metavar"]
        elif field.name.endswith("_s") and hint is not bool:
            kwargs["metavar"] = "SECONDS"
        if field.metadata.get("parse"):
            kwargs["type"] = field.metadata["parse"]
        elif hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction if default or overrides_only else "store_true"
        elif typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            kwargs.update(type=item, nargs="+")
        else:
            kwargs["type"] = hint
            if field.metadata.get("choices"):
                kwargs["choices"] = list(field.metadata["choices"])
        if default is _MISSING and not overrides_only:
            kwargs["required"] = True
        else:
            kwargs["default"] = None if overrides_only else default
        if optional and hint is not bool and not overrides_only:
            kwargs.setdefault("default", None)
        parser.add_argument(flag_of(field), **kwargs)


def from_args(cls: type, args: argparse.Namespace, **values: Any) -> Any:
    """An instance of `cls` from the parsed options of `add_settings` (those that are not None), and
    `values` (fields set by code, or options parsed differently)."""
    for field in cli_fields(cls):
        if field.name in values or not hasattr(args, field.name):
            continue
        value = getattr(args, field.name)
        if value is not None:
            values[field.name] = value
    return cls(**values)


def given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The `overrides_only` options of `cls` that were given, by field name."""
    return {f.name: getattr(args, f.name) for f in cli_fields(cls) if getattr(args, f.name, None) is not None}
