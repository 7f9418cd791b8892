"""Driving Debian's Chromium with playwright (browser tests, the dashboard benchmark, screenshots):
playwright's own browser download cannot work on these machines. The flags keep a headless Chromium
off the (closed) network: no background connections, no component updates, no QUIC."""

from __future__ import annotations

import os

CHROMIUM = os.environ.get("SWARM_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def launch(playwright):
    """A headless Chromium browser from a started `sync_playwright()` (or its async twin)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
