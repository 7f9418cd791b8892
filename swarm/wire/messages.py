"""Parsing of wire messages with a clear error for malformed bytes."""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from swarm.wire.codec import WireError


def parse(message_cls: type, raw: bytes, what: str | None = None) -> Message:
    message = message_cls()
    try:
        message.ParseFromString(raw)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise WireError(f"malformed {what or message_cls.__name__}: {e}") from None
    return message
