"""Serving the dashboard with uvicorn: `DashboardServer` (a background thread of this process, for
`swarm local`, tests and benchmarks) and `serve_forever` (the current event loop, for `swarm dashboard`
as its own process). Both bind the socket themselves, so port 0 picks a free port and the URL is
known before the first request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType

import uvicorn

from swarm.dashboard.app import create_app
from swarm.dashboard.source import StateSource

logger = logging.getLogger(__name__)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _server(source: StateSource, refresh_s: float) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(source, refresh_s=refresh_s),
        lifespan="on",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


class DashboardServer:
    """uvicorn serving the dashboard in a daemon thread of the current process."""

    def __init__(self, source: StateSource, host: str = "127.0.0.1", port: int = 0, refresh_s: float = 1.0) -> None:
        self.source = source
        self.host = host
        self.port = port
        self.refresh_s = refresh_s
        self.url: str | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 15.0) -> str:
        """Start serving; returns the URL once the server accepts connections (raises RuntimeError
        when it has not within `timeout_s`)."""
        if self._thread is not None:
            raise RuntimeError("dashboard server already started")
        sock = _bind(self.host, self.port)
        url = _url(sock)
        self._server = _server(self.source, self.refresh_s)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.name = "swarm-dashboard"
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                sock.close()
                raise RuntimeError(f"dashboard server did not start within {timeout_s} s")
            time.sleep(0.02)
        self.url = url
        logger.info("dashboard at %s", url)
        return url

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving and join the thread (a no-op when not started)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive() and self._server is not None:
                self._server.force_exit = True
                self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("dashboard server thread did not stop within %s s", 2 * timeout_s)
        self._server, self._thread = None, None

    def __enter__(self) -> DashboardServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


async def serve_forever(
    source: StateSource,
    host: str = "127.0.0.1",
    port: int = 0,
    refresh_s: float = 1.0,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve in the current event loop until cancelled or SIGINT/SIGTERM (uvicorn handles the signals
    when this runs in the main thread, then re-raises them once shut down). `on_ready(url)` is called
    once the server accepts connections."""
    sock = _bind(host, port)
    url = _url(sock)
    server = _server(source, refresh_s)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="dashboard-uvicorn")
    try:
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)
        if server.started:
            logger.info("dashboard at %s", url)
            if on_ready is not None:
                on_ready(url)
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            async with asyncio.timeout(5.0):
                await asyncio.shield(serving)
        raise
    finally:
        sock.close()
    if not server.started:
        raise RuntimeError("dashboard server failed to start")
