"""The dashboard on a live swarm, as a user opens it: `swarm local --dashboard-port 0` prints the URL
before training starts; in Debian's Chromium every stage shows its peers, the step and the loss move,
a SIGKILLed peer's card turns dead within 15 s with the event in the feed, no console error; the API
agrees with `swarm status --json`, /metrics has the documented families, unknown paths are 404, and
the dashboard keeps answering when the swarm is gone."""

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarm.dashboard.browser import launch
from tests.integration.helpers import assert_all_reaped, run_args, wait_for

STATE_KEYS = {"run", "step", "samples_per_s", "stages", "trainers", "events", "history"}
PEER_KEYS = {"peer_id", "state", "throughput", "queue", "step", "last_seen_s", "address"}
TRAINER_KEYS = {"trainer_id", "step", "loss", "val_loss", "samples_per_s"}
EVENT_KEYS = {"time", "kind", "peer_id", "detail"}
METRICS = {
    "swarm_peers",
    "swarm_stage_throughput_samples_per_second",
    "swarm_global_step",
    "swarm_train_loss",
    "swarm_val_loss",
    "swarm_samples_per_second",
    "swarm_events_total",
}


def get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def state(url: str) -> dict:
    status, body = get(url + "api/v1/state")
    assert status == 200
    return json.loads(body)


class Swarm:
    """`swarm local` as a subprocess; its stdout lines collected by a thread."""

    def __init__(self, tmp_path) -> None:
        argv = [
            sys.executable, "-m", "swarm.cli", "local", "--stages", "2", "--peers-per-stage", "2",
            "--steps", "100000", "--dashboard-port", "0", "--log-dir", str(tmp_path / "logs"), *run_args(),
            "--trainer-arg=--val-every", "--trainer-arg=3", "--trainer-arg=--val-samples", "--trainer-arg=8",
        ]  # fmt: skip
        self.stderr_path = tmp_path / "local.err"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: list[str] = []
        self.seen: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def descendants(self) -> list[psutil.Process]:
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        self.seen.update(k.pid for k in kids)
        return kids

    def stderr_tail(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        """Ctrl-C, as a user stops it: `swarm local` stops every process within the trainers' and
        peers' grace periods (15 s each) without having to kill one, even when the swarm's peers are
        gone already (then a trainer's final validation has nobody to ask: it is left out)."""
        self.descendants()
        hung = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=45)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGUSR1)  # its threads' stacks, into local.err
                time.sleep(1)  # not a synchronization: lets faulthandler write before the kill
                self.proc.kill()
                self.proc.wait(timeout=10)
                hung = self.stderr_tail()
        for pid in sorted(self.seen) if hung else []:  # not left behind for the next tests
            try:
                psutil.Process(pid).kill()
            except psutil.Error:
                pass
        assert_all_reaped([], sorted(self.seen))
        assert hung is None, f"swarm local did not stop within 45 s of SIGINT:\n{hung}"
        assert "did not stop within" not in self.stderr_tail(), self.stderr_tail()


@pytest.fixture
def live(tmp_path):
    swarm = Swarm(tmp_path)
    try:
        yield swarm
    finally:
        swarm.stop()


def peer_process(swarm: Swarm, address: str) -> psutil.Process:
    """The peer process that listens at `address` (its gRPC port)."""
    port = int(address.rsplit(":", 1)[1])
    for p in swarm.descendants():
        try:
            if "peer" in p.cmdline() and any(c.laddr.port == port for c in p.net_connections(kind="tcp")):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no peer process listens at {address}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_live_dashboard_in_chromium(live, tmp_path):
    from playwright.sync_api import sync_playwright

    def dashboard_url():
        return next((ln.split(" ", 1)[1] for ln in live.lines if ln.startswith("dashboard: ")), None)

    url = wait_for(dashboard_url, 120, "the dashboard's URL")
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url)
    started = [ln for ln in live.lines if ln.startswith("starting ")]
    assert not started or live.lines.index(f"dashboard: {url}") < live.lines.index(started[0])

    def training() -> dict | None:
        doc = state(url)
        return doc if doc["step"] >= 3 and doc["trainers"] else None

    doc = wait_for(training, 180, "training to show on the dashboard")
    check_api(doc)
    check_against_status(url, live)
    check_metrics(url)
    with sync_playwright() as p:
        browser = launch(p)
        try:
            check_page(browser, url, live, tmp_path)
        finally:
            browser.close()
    check_bad_requests(url)
    # the swarm goes away: the dashboard keeps answering, and says what it sees
    for proc in live.descendants():
        try:
            if "coordinator" in proc.cmdline() or "peer" in proc.cmdline():
                proc.send_signal(signal.SIGKILL)
        except psutil.Error:  # gone already (a zombie until `swarm local` reaps it)
            continue
    wait_for(lambda: not state(url)["healthy"], 60, "the swarm to show as gone")
    assert get(url + "healthz")[0] == 200


def check_api(doc: dict) -> None:
    assert STATE_KEYS <= set(doc)
    assert doc["run"]["num_stages"] == 2 and doc["run"]["run_id"]
    assert [s["stage"] for s in doc["stages"]] == [0, 1]
    for stage in doc["stages"]:
        assert len(stage["peers"]) == 2
        for peer in stage["peers"]:
            assert PEER_KEYS <= set(peer) and peer["state"] == "online"
    assert TRAINER_KEYS <= set(doc["trainers"][0])
    assert all(EVENT_KEYS <= set(e) for e in doc["events"])
    assert any(e["kind"] == "join" for e in doc["events"])
    assert set(doc["history"]) >= {"step", "loss", "val_loss", "samples_per_s"}


def check_against_status(url: str, live: Swarm) -> None:
    run_id = next(ln.split(": ", 1)[1] for ln in live.lines if ln.startswith("run id: "))
    maddrs = next(ln.split(": ", 1)[1] for ln in live.lines if ln.startswith("coordinator: ")).split()
    before = state(url)["step"]
    status = subprocess.run(
        [sys.executable, "-m", "swarm.cli", "status", "--run-id", run_id, "--initial-peers", *maddrs, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert status.returncode == 0, status.stderr[-2000:]
    st = json.loads(status.stdout)
    later = state(url)
    for mine, theirs in zip(later["stages"], st["stages"], strict=True):
        assert {p["peer_id"] for p in mine["peers"]} == {p["id"] for p in theirs["peers"]}
        assert {p["address"] for p in mine["peers"]} == {p["address"] for p in theirs["peers"]}
        assert {p["state"] for p in mine["peers"]} == {p["state"] for p in theirs["peers"]}
    assert before - 1 <= st["step"] <= later["step"] + 1  # the same global step, read while training


def check_bad_requests(url: str) -> None:
    for path in ("nope", "api/v1/nope", "api/v2/state", "metrics/x"):
        assert get(url + path)[0] == 404, path
    for query in ("api/v1/state?x=%ZZ&&&", "metrics?%%%", "?;;;=="):
        assert get(url + query)[0] in (200, 400), query
    assert get(url + "healthz")[0] == 200


def check_metrics(url: str) -> None:
    status, body = get(url + "metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    samples = {s.name for f in families.values() for s in f.samples}  # a counter's family drops "_total"
    assert METRICS <= samples, METRICS - samples
    peers = {(s.labels["stage"], s.labels["state"]): s.value for s in families["swarm_peers"].samples}
    assert peers[("0", "online")] == 2 and peers[("1", "online")] == 2
    assert families["swarm_global_step"].samples[0].value >= 3


def check_page(browser, url: str, live: Swarm, tmp_path) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto(url)
    page.wait_for_function("window.__swarmRendered !== undefined", timeout=15_000)
    assert page.locator("#stage-map [data-stage]").count() == 2
    assert page.locator("#stage-map .peer").count() == 4
    step = page.locator("#step").inner_text()
    page.wait_for_function("s => document.getElementById('step').textContent !== s", arg=step, timeout=15_000)
    doc = state(url)
    victim = doc["stages"][1]["peers"][0]
    proc = peer_process(live, victim["address"])
    killed = time.monotonic()
    proc.send_signal(signal.SIGKILL)
    card = f'.peer[data-peer="{victim["peer_id"]}"]'
    page.wait_for_selector(f"{card}.s-dead, {card}.s-offline", timeout=15_000)
    print(f"the killed peer's card turned dead {time.monotonic() - killed:.1f} s after the kill")
    feed = page.locator("#events li", has_text=victim["peer_id"][-8:])
    feed.first.wait_for(timeout=15_000)
    page.screenshot(path=str(tmp_path / "dashboard-live.png"), full_page=True)
    assert problems == [], problems
