"""A screenshot of the live dashboard for the docs: `swarm local --dashboard-port 0` (3 stages x 2
peers and a trainer, the default GPT), a few dozen steps, one peer SIGKILLed so that a dead card and
its event show, then a full-page screenshot in Debian's Chromium.

    python scripts/dashboard_screenshot.py --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.dashboard.browser import launch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/dashboard.png")
    parser.add_argument("--steps-before-kill", type=int, default=40)
    args = parser.parse_args()
    argv = [sys.executable, "-m", "swarm.cli", "local", "--steps", "100000", "--dashboard-port", "0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(ln.rstrip() for ln in proc.stdout), daemon=True).start()
    try:
        url = _wait(lambda: next((ln.split(" ", 1)[1] for ln in lines if ln.startswith("dashboard: ")), None), 180)
        _wait(lambda: _state(url)["step"] >= args.steps_before_kill, 600)
        victim = _state(url)["stages"][1]["peers"][0]
        _kill_peer(proc.pid, victim["address"])
        _wait(lambda: any(p["state"] == "dead" for s in _state(url)["stages"] for p in s["peers"]), 60)
        time.sleep(3)  # a few more points on the plots
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = launch(p)
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.goto(url)
            page.wait_for_function("window.__swarmRendered !== undefined", timeout=15_000)
            page.locator(".peer.s-online").first.click()
            time.sleep(1.5)
            page.screenshot(path=args.out, full_page=True)
            browser.close()
        print(json.dumps({"screenshot": args.out, "url": url}))
        return 0
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/v1/state", timeout=5) as resp:
        return json.loads(resp.read())


def _wait(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(0.5)
    raise TimeoutError("timed out")


def _kill_peer(root_pid: int, address: str) -> None:
    port = int(address.rsplit(":", 1)[1])
    for p in psutil.Process(root_pid).children(recursive=True):
        try:
            if "peer" in p.cmdline() and any(c.laddr.port == port for c in p.net_connections(kind="tcp")):
                p.send_signal(signal.SIGKILL)
                return
        except psutil.Error:
            continue
    raise RuntimeError(f"no peer at {address}")


if __name__ == "__main__":
    sys.exit(main())
