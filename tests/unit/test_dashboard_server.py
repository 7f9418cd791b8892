"""Serving the dashboard for real: DashboardServer in a thread and serve_forever in an event loop."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import pytest

from swarm.dashboard.server import DashboardServer, serve_forever
from swarm.dashboard.synthetic import SyntheticSource

pytestmark = pytest.mark.timeout(60)


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _raw(url: str, request_line: bytes) -> int:
    """Send one hand-written request; the status code of the answer (0 when the server just closed)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=5) as sock:
        sock.sendall(request_line + b"\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def test_dashboard_server_starts_serves_and_stops():
    server = DashboardServer(SyntheticSource(peers=20, stages=2, death_rate=0.0), port=0, refresh_s=0.2)
    url = server.start()
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/") and not url.endswith(":0/")
        status, body = _get(url + "healthz")
        assert status == 200 and json.loads(body)["source_ok"] is True
        status, body = _get(url + "api/v1/state")
        assert status == 200 and len(json.loads(body)["stages"]) == 2
        for line in (
            b"GET /api/v1/state?x=%ZZ&&& HTTP/1.1",
            b"GET /?%%%%;;==&& HTTP/1.1",
            b"GET /metrics?\xff HTTP/1.1",
        ):
            assert _raw(url, line) in (0, 200, 400), line
        assert _raw(url, b"POST /api/v1/state HTTP/1.1") == 405
        assert _raw(url, b"GET /api/nothing HTTP/1.1") == 404
    finally:
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 5.0
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "healthz", timeout=2)


def test_dashboard_server_as_context_manager_with_open_keepalive_connection():
    with DashboardServer(SyntheticSource(peers=8, stages=2, death_rate=0.0)) as server:
        parts = urlsplit(server.url)
        idle = socket.create_connection((parts.hostname, parts.port), timeout=5)  # a browser's idle keep-alive
        assert _get(server.url)[0] == 200
    idle.close()
    assert server.url is not None


def test_serve_forever_until_cancelled():
    async def main() -> None:
        ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        source = SyntheticSource(peers=8, stages=2, death_rate=0.0)
        task = asyncio.create_task(serve_forever(source, "127.0.0.1", 0, 0.2, on_ready=ready.set_result))
        url = await asyncio.wait_for(ready, 10)
        status, body = await asyncio.to_thread(_get, url + "api/v1/state")
        assert status == 200 and json.loads(body)["run"]["num_stages"] == 2
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert time.monotonic() - started < 5.0
        with pytest.raises(OSError):
            await asyncio.to_thread(urllib.request.urlopen, url + "healthz", None, 2)

    asyncio.run(main())
