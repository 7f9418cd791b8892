"""Deferred imports: a module that a dependency imports at its top but this process may never use is
stood in for, in `sys.modules`, by a placeholder that imports the real module on first use of one of
its attributes.

Why: hivemind's package imports its averaging code, which imports `scipy.optimize` (about 0.6 s of
CPU at every process start, a fifth of a peer's start-up), though only a peer's averager ever calls
it (hivemind's load balancing of an all-reduce). Trainers, coordinators, `swarm status` and the rest
never do, and a peer pays it in its averager, when it first averages. (The standard library's
LazyLoader does not do here: on Python 3.11 an `import` of a module already in `sys.modules` reads
its `__spec__`, which makes LazyLoader load it at once.)"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

# what hivemind imports and most of our processes never use
HIVEMIND_DEFERRED = ("scipy.optimize",)


class _Deferred(types.ModuleType):
    """Stands in for a module until an attribute of it is read; then imports it for real (the import
    puts the real module in `sys.modules` and on its parent package) and answers from it."""

    def __getattr__(self, attr: str):
        real = self.__dict__.get("_deferred_real")
        if real is None:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            real = importlib.import_module(self.__name__)
            self.__dict__["_deferred_real"] = real
        return getattr(real, attr)


def defer(name: str) -> None:
    """Stand in for `name` until it is used (a no-op if it is imported already or cannot be found: the
    normal import then happens, or fails, where it is used)."""
    if name in sys.modules:
        return
    try:
        if importlib.util.find_spec(name) is None:
            return
    except (ImportError, ValueError):
        return
    placeholder = _Deferred(name)
    sys.modules[name] = placeholder
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, placeholder)


def defer_hivemind_extras() -> None:
    for name in HIVEMIND_DEFERRED:
        defer(name)
