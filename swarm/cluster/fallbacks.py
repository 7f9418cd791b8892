"""The fallbacks a peer reports in Info (what its stage did off the normal path: a stall, a failed
averaging round, a dropped duplicate), parsed and summed."""

from __future__ import annotations

import json


def fallbacks_of(text: str) -> dict[str, int]:
    """A peer's Info `fallbacks` (JSON: kind -> count); anything malformed reads as none."""
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}


def fallback_totals(statuses) -> dict[str, int]:
    """The fallbacks every peer in `statuses` reported, summed by kind."""
    totals: dict[str, int] = {}
    for s in statuses:
        for kind, n in s.fallbacks.items():
            totals[kind] = totals.get(kind, 0) + n
    return totals


__all__ = ["fallback_totals", "fallbacks_of"]
