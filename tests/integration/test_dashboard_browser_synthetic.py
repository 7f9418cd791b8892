"""The dashboard page in a real browser (Debian's Chromium through playwright) over a synthetic swarm:
it draws every stage and peer, follows the step, shows a killed peer dead with its event, keeps a
peer's detail open across refreshes, flags a stage with no live peer, and logs no error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from playwright import sync_api  # noqa: E402 - a test dependency (pyproject's test extra)

from swarm.dashboard.browser import CHROMIUM, launch
from swarm.dashboard.server import DashboardServer
from swarm.dashboard.synthetic import SyntheticSource

pytestmark = pytest.mark.timeout(90)

PEERS, STAGES = 200, 4


@pytest.fixture
def browser():
    assert os.path.exists(CHROMIUM), (
        f"no Chromium at {CHROMIUM}: scripts/test.sh installs Debian's (apt-get install chromium)"
    )
    with sync_api.sync_playwright() as p:
        browser = launch(p)
        yield browser
        browser.close()


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/v1/state", timeout=5) as resp:
        return json.loads(resp.read())


def _online(doc: dict, stage: int) -> list[dict]:
    return [p for p in doc["stages"][stage]["peers"] if p["state"] == "online"]


def test_dashboard_in_chromium(browser, tmp_path):
    source = SyntheticSource(peers=PEERS, stages=STAGES, seed=5, death_rate=0.0)
    server = DashboardServer(source, refresh_s=0.5)
    url = server.start()
    try:
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        page.goto(url)
        page.wait_for_function("window.__swarmRendered !== undefined", timeout=10_000)

        assert page.locator("#stage-map [data-stage]").count() == STAGES
        assert page.locator("#stage-map .peer").count() == PEERS
        assert page.locator("#security").inner_text() == "open swarm"
        assert page.locator("#run-id").inner_text() == "synthetic-5"
        assert page.locator("#events li").count() == 200

        step = page.locator("#step").inner_text()
        page.wait_for_function("s => document.getElementById('step').textContent !== s", arg=step, timeout=3_000)

        _check_kill_and_detail(page, source, _state(url))
        _check_alerts_and_dead_stage(page, source, _state(url))
        page.screenshot(path=str(tmp_path / "dashboard.png"))
        assert problems == []

        server.stop()  # the browser logs the refused fetches itself: checked after the error assertion
        page.wait_for_selector("#alerts :text('API unreachable')", timeout=5_000)
    finally:
        server.stop()


def _check_kill_and_detail(page, source: SyntheticSource, doc: dict) -> None:
    victim, other = _online(doc, 0)[:2]
    source.kill(victim["peer_id"])
    page.wait_for_selector(f'.peer.s-dead[data-peer="{victim["peer_id"]}"]', timeout=5_000)
    assert "unreachable" in page.locator(f'.peer[data-peer="{victim["peer_id"]}"] .st').inner_text()
    feed = page.locator("#events li.k-failure", has_text=victim["peer_id"][-8:])
    feed.first.wait_for(timeout=5_000)
    times = [float(t) for t in page.locator("#events li").evaluate_all("els => els.map(e => e.dataset.time)")]
    assert times == sorted(times, reverse=True), "newest event first"

    page.locator(f'.peer[data-peer="{other["peer_id"]}"]').click()
    page.wait_for_selector("#detail:not([hidden])", timeout=2_000)
    assert page.locator('#detail [data-field="address"]').inner_text() == other["address"]
    renders = page.evaluate("window.__swarmRenders")
    page.wait_for_function("n => window.__swarmRenders >= n + 2", arg=renders, timeout=5_000)
    assert page.locator("#detail").is_visible(), "the detail stays open across refreshes"
    assert page.locator('#detail [data-field="address"]').inner_text() == other["address"]
    assert page.locator(f'.peer.sel[data-peer="{other["peer_id"]}"]').count() == 1
    page.keyboard.press("Escape")
    assert page.locator("#detail").is_hidden()


def _check_alerts_and_dead_stage(page, source: SyntheticSource, doc: dict) -> None:
    thin = doc["bottleneck"]
    for peer in doc["stages"][thin]["peers"]:
        if peer["state"] != "dead":
            source.kill(peer["peer_id"])
    column = page.locator(f'.stage.nolive[data-stage="{thin}"]')
    column.wait_for(timeout=5_000)
    assert "no live peer" in column.inner_text()
    assert "unhealthy" in page.locator("#health").inner_text()

    source.dht_ok = False
    source.error = "collector down"
    page.wait_for_selector("#alerts :text('source error: RuntimeError: collector down')", timeout=5_000)
    source.error = None
    page.wait_for_selector("#alerts :text('DHT unreachable')", timeout=5_000)
    source.dht_ok = True
    page.wait_for_function("!document.getElementById('alerts').textContent", timeout=5_000)


def test_bench_dashboard_quick(browser):
    """scripts/bench_dashboard.py --quick runs and meets its targets (API p95 < 200 ms, render < 1 s)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_dashboard.py"
    out = subprocess.run([sys.executable, str(script), "--quick"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"api_p50_ms", "api_p95_ms", "render_ms", "peers", "stages"} <= set(result)
    assert result["peers"] == 100 and result["stages"] == 4 and result["render_ms"] is not None
    assert result["targets_met"], result
