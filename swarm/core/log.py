"""Logging with the process's role, peer, stage and step in every line.

Each module keeps its own `logging.getLogger(__name__)`; a filter on the root handler fills in the
context fields from `LOG_CONTEXT`, which the role code updates as the peer moves or steps.
"""

from __future__ import annotations

import logging
import os
import sys

LOG_CONTEXT: dict[str, object] = {"role": "-", "peer": "-", "stage": "-", "step": "-"}

FORMAT = "%(asctime)s %(levelname).1s [%(role)s %(peer)s stage=%(stage)s step=%(step)s] %(name)s: %(message)s"


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in LOG_CONTEXT.items():
            setattr(record, key, value)
        return True


def set_context(**fields: object) -> None:
    LOG_CONTEXT.update(fields)


def setup_logging(role: str, level: str | None = None) -> None:
    """Log to stderr (stdout is kept for the parseable lines: ready, progress, summary JSON)."""
    LOG_CONTEXT["role"] = role
    level = (level or os.environ.get("SWARM_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(_ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # hivemind installs its own handler and is chatty at INFO; keep its warnings.
    hm = logging.getLogger("hivemind")
    hm.handlers[:] = []
    hm.propagate = True
    hm.setLevel(os.environ.get("SWARM_HIVEMIND_LOG_LEVEL", "WARNING"))
