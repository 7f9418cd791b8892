"""The dashboard app over a synthetic swarm: the state document, /metrics, /healthz, errors and the page."""

from __future__ import annotations

import json
import math
import re
import time
import warnings

import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.dashboard.app import create_app
from swarm.dashboard.source import LIVE_STATES, PEER_STATES, REQUIRED_KEYS, StaticSource
from swarm.dashboard.synthetic import SyntheticSource, synthetic_state

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # starlette >= 1 prefers httpx2 over httpx; both work
    from starlette.testclient import TestClient

pytestmark = pytest.mark.timeout(60)

ROUTES = ("/", "/api/v1/state", "/metrics", "/healthz")


@pytest.fixture
def client():
    # a long refresh: the cache holds one document for the whole test, so /api and /metrics agree
    app = create_app(SyntheticSource(peers=60, stages=4, seed=3, death_rate=0.0), refresh_s=60.0)
    with TestClient(app) as c:
        yield c


def _wait(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_state_document_keys_and_consistency(client):
    resp = client.get("/api/v1/state")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/json")
    doc = resp.json()
    assert set(REQUIRED_KEYS) <= set(doc) and "source_error" not in doc
    assert {"run_id", "model", "num_stages", "sync", "codec", "global_batch", "security"} <= set(doc["run"])
    assert len(doc["stages"]) == doc["run"]["num_stages"] == 4
    assert sum(len(s["peers"]) for s in doc["stages"]) == 60
    for k, stage in enumerate(doc["stages"]):
        live = [p for p in stage["peers"] if p["state"] in LIVE_STATES]
        assert stage["stage"] == k and stage["live_peers"] == len(live)
        assert stage["throughput"] == pytest.approx(sum(p["throughput"] for p in live), abs=0.05)
        for peer in stage["peers"]:
            assert peer["state"] in PEER_STATES
            assert {"peer_id", "throughput", "queue", "step", "last_seen_s", "address", "uptime_s"} <= set(peer)
            assert {"samples_processed", "failures", "moves", "device"} <= set(peer)
    throughputs = [s["throughput"] for s in doc["stages"]]
    assert doc["bottleneck"] == throughputs.index(min(throughputs))
    assert doc["healthy"] is all(s["live_peers"] > 0 for s in doc["stages"])
    history = doc["history"]
    assert len({len(v) for v in history.values()}) == 1 and len(history["time"]) >= 500
    assert all(len(row) == 4 for row in history["peers_per_stage"])
    assert history["time"] == sorted(history["time"])
    for event in doc["events"]:
        assert {"time", "kind", "peer_id", "detail"} <= set(event)
    for kind in {e["kind"] for e in doc["events"]}:
        assert doc["events_total"][kind] >= sum(e["kind"] == kind for e in doc["events"])
    assert doc["trainers"] and {"trainer_id", "step", "loss", "val_loss", "samples_per_s"} <= set(doc["trainers"][0])


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_match_the_document(client):
    doc = client.get("/api/v1/state").json()
    resp = client.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    fams = _families(resp.text)
    peers = {(s.labels["stage"], s.labels["state"]): s.value for s in fams["swarm_peers"].samples}
    for stage in doc["stages"]:
        for state in PEER_STATES:
            expected = sum(p["state"] == state for p in stage["peers"])
            assert peers[(str(stage["stage"]), state)] == expected
    tput = {s.labels["stage"]: s.value for s in fams["swarm_stage_throughput_samples_per_second"].samples}
    assert tput == {str(s["stage"]): pytest.approx(s["throughput"]) for s in doc["stages"]}
    scalar = {name: fams[name].samples[0].value for name in fams if not fams[name].samples[0].labels}
    assert scalar["swarm_global_step"] == doc["step"]
    assert scalar["swarm_samples_per_second"] == pytest.approx(doc["samples_per_s"])
    losses = [t["loss"] for t in doc["trainers"]]
    val_losses = [t["val_loss"] for t in doc["trainers"]]
    assert scalar["swarm_train_loss"] == pytest.approx(sum(losses) / len(losses))
    assert scalar["swarm_val_loss"] == pytest.approx(sum(val_losses) / len(val_losses))
    assert scalar["swarm_source_ok"] == 1.0
    assert fams["swarm_events"].type == "counter"
    events = {s.labels["kind"]: s.value for s in fams["swarm_events"].samples if s.name == "swarm_events_total"}
    assert events == {k: float(v) for k, v in doc["events_total"].items()}


def test_loss_falls_back_to_history_when_no_trainer_reports():
    doc = synthetic_state(peers=8, stages=2)
    doc["trainers"] = []
    doc["history"]["loss"][-1] = None
    expected = next(v for v in reversed(doc["history"]["loss"]) if v is not None)
    with TestClient(create_app(StaticSource(doc), refresh_s=60.0)) as client:
        fams = _families(client.get("/metrics").text)
    assert fams["swarm_train_loss"].samples[0].value == pytest.approx(expected)


def test_healthz(client):
    resp = client.get("/healthz")
    assert resp.status_code == 200
    body = resp.json()
    assert body["status"] == "ok" and body["source_ok"] is True and body["snapshots"] >= 1


def test_unknown_paths_are_404(client):
    for path in ("/nope", "/static/app.js", "/api/v1/state/extra", "/index.html"):
        assert client.get(path).status_code == 404
    resp = client.get("/api/v2/state")
    assert resp.status_code == 404 and resp.json()["error"] == "Not Found"


@pytest.mark.parametrize("query", ["x=%ZZ&&&", "%", "a=%00%FF", "==&=&a==b", ";;;", "x=" + "y" * 5000, "a[]=1&a[]=2"])
def test_malformed_queries_never_fail(client, query):
    for path in ROUTES:
        assert client.get(f"{path}?{query}").status_code in (200, 400)


def test_other_methods_are_405(client):
    for path in ROUTES:
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            resp = client.request(method, path)
            assert resp.status_code == 405, (method, path)
            assert "GET" in resp.headers["allow"]
    assert client.post("/api/v1/state").json()["status"] == 405
    assert client.head("/api/v1/state").status_code == 200


class FlakySource:
    """Good documents until `fail` is set, then raises (or returns garbage)."""

    def __init__(self) -> None:
        self.inner = SyntheticSource(peers=12, stages=3, death_rate=0.0)
        self.fail: str | None = None
        self.last_good: dict | None = None

    async def snapshot(self) -> dict:
        if self.fail == "raise":
            raise ConnectionError("DHT poll timed out")
        if self.fail == "garbage":
            return ["not", "a", "document"]  # type: ignore[return-value]
        self.last_good = await self.inner.snapshot()
        return self.last_good


@pytest.mark.parametrize("mode", ["raise", "garbage"])
def test_failing_source_serves_last_good_document(mode):
    source = FlakySource()
    with TestClient(create_app(source, refresh_s=0.05)) as client:
        assert "source_error" not in client.get("/api/v1/state").json()
        source.fail = mode
        _wait(lambda: client.get("/healthz").json()["source_ok"] is False)
        doc = client.get("/api/v1/state").json()
        assert doc["source_error"] and doc["step"] == source.last_good["step"]
        assert ("DHT poll timed out" in doc["source_error"]) == (mode == "raise")
        assert client.get("/").status_code == 200
        fams = _families(client.get("/metrics").text)
        assert fams["swarm_source_ok"].samples[0].value == 0.0
        assert fams["swarm_global_step"].samples[0].value == source.last_good["step"]
        source.fail = None
        _wait(lambda: "source_error" not in client.get("/api/v1/state").json())
        assert client.get("/healthz").json()["source_ok"] is True


def test_source_failing_from_the_start_still_answers():
    source = FlakySource()
    source.fail = "raise"
    with TestClient(create_app(source, refresh_s=0.05)) as client:
        doc = client.get("/api/v1/state").json()
        assert doc["source_error"] and doc["stages"] == [] and set(REQUIRED_KEYS) <= set(doc)
        assert client.get("/metrics").status_code == 200
        assert client.get("/healthz").json()["source_ok"] is False


def test_non_finite_numbers_become_null():
    doc = synthetic_state(peers=8, stages=2)
    doc["samples_per_s"] = math.nan
    doc["trainers"][0]["loss"] = math.inf
    with TestClient(create_app(StaticSource(doc), refresh_s=60.0)) as client:
        text = client.get("/api/v1/state").text
        assert client.get("/metrics").status_code == 200

    def reject(name: str) -> None:
        raise AssertionError(f"{name} in JSON")

    parsed = json.loads(text, parse_constant=reject)
    assert parsed["samples_per_s"] is None and parsed["trainers"][0]["loss"] is None


def test_page_is_self_contained(client):
    resp = client.get("/")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/html")
    html = resp.text
    assert re.findall(r"https?://", html) == [], "the page must not reference another host (no CDN)"
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=\"(?!data:)", html), "no external resources"
    for marker in ('id="stage-map"', 'id="events"', 'id="detail"', "SwarmPlots", "api/v1/state", "__swarmRendered"):
        assert marker in html
    assert "/*SCRIPT*/" not in html and "/*STYLE*/" not in html and "__POLL_MS__" not in html


def test_refresh_must_be_positive():
    with pytest.raises(ValueError):
        create_app(StaticSource(synthetic_state(8, 2)), refresh_s=0)
