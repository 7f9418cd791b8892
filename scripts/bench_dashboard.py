#!/usr/bin/env python
"""Dashboard benchmark: API latency and page render time over a synthetic swarm (default 1,000 peers
in 8 stages), served by the real DashboardServer and drawn by Debian's Chromium through playwright.

    python scripts/bench_dashboard.py [--quick] [--peers N] [--stages S] [--requests R] [--no-browser]

The last stdout line is JSON: api_p50_ms, api_p95_ms, api_max_ms, metrics_p50_ms, state_bytes,
render_ms (navigation start to the stage map fully drawn, median over page loads), render_js_ms,
peers, stages, targets_met (API p95 < 200 ms, render < 1 s). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from swarm.dashboard.browser import CHROMIUM, launch  # noqa: E402
from swarm.dashboard.server import DashboardServer  # noqa: E402
from swarm.dashboard.synthetic import SyntheticSource  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def latencies_ms(url: str, requests: int) -> tuple[list[float], int]:
    """Wall time of `requests` full GETs (a new connection each, as a fresh poller would), sorted."""
    times, size = [], 0
    for _ in range(requests):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as resp:
            size = len(resp.read())
        times.append((time.perf_counter() - start) * 1000)
    return sorted(times), size


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def render_ms(url: str, loads: int) -> tuple[float | None, float | None]:
    """(median navigation-to-drawn time, median JS render time) over `loads` fresh page loads."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        log("playwright is not installed: no render figure")
        return None, None
    if not os.path.exists(CHROMIUM):
        log(f"no Chromium at {CHROMIUM}: no render figure")
        return None, None
    drawn, js = [], []
    with sync_playwright() as p:
        browser = launch(p)
        try:
            for i in range(loads + 1):  # the first load warms Chromium up and is not counted
                page = browser.new_page(viewport={"width": 1600, "height": 1000})
                page.goto(url)
                page.wait_for_function("window.__swarmRendered !== undefined", timeout=30_000)
                if i:
                    drawn.append(page.evaluate("window.__swarmRendered"))
                    js.append(page.evaluate("window.__swarmLastRenderMs"))
                page.close()
        finally:
            browser.close()
    return statistics.median(drawn), statistics.median(js)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 peers in 4 stages, 10 requests, 1 page load")
    parser.add_argument("--peers", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--loads", type=int, default=None, help="page loads to time (default 5, quick 1)")
    parser.add_argument("--no-browser", action="store_true")
    args = parser.parse_args()
    peers = args.peers or (100 if args.quick else 1000)
    stages = args.stages or (4 if args.quick else 8)
    requests = args.requests or (10 if args.quick else 50)
    loads = args.loads or (1 if args.quick else 5)

    with DashboardServer(SyntheticSource(peers=peers, stages=stages), refresh_s=1.0) as server:
        log(f"serving {peers} synthetic peers in {stages} stages at {server.url}")
        api, size = latencies_ms(server.url + "api/v1/state", requests)
        metrics, _ = latencies_ms(server.url + "metrics", max(5, requests // 5))
        log(f"api: p50 {percentile(api, 0.5):.1f} ms, p95 {percentile(api, 0.95):.1f} ms ({size} bytes)")
        drawn, js = (None, None) if args.no_browser else render_ms(server.url, loads)
        if drawn is not None:
            log(f"render: {drawn:.0f} ms from navigation start to the stage map drawn ({js:.0f} ms of it in JS)")
    result = {
        "api_p50_ms": round(percentile(api, 0.5), 2),
        "api_p95_ms": round(percentile(api, 0.95), 2),
        "api_max_ms": round(api[-1], 2),
        "metrics_p50_ms": round(percentile(metrics, 0.5), 2),
        "state_bytes": size,
        "render_ms": None if drawn is None else round(drawn, 1),
        "render_js_ms": None if js is None else round(js, 1),
        "peers": peers,
        "stages": stages,
        "requests": requests,
        "page_loads": 0 if drawn is None else loads,
    }
    result["targets_met"] = result["api_p95_ms"] < 200 and (drawn is None or drawn < 1000)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
