"""The dashboard's Starlette app: the page (`/`), the state document (`/api/v1/state`), Prometheus
metrics (`/metrics`) and liveness (`/healthz`).

A background task (the app's lifespan) asks the source for a snapshot every `refresh_s` and caches
it, serialized; requests only ever read that cache, so any number of open pages costs the swarm one
poll per interval. A failing source never turns into a 500: the last good document is served with
`"source_error"` added.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from swarm.dashboard.metrics import render_metrics
from swarm.dashboard.source import StateSource, check_state, empty_state, finite

logger = logging.getLogger(__name__)

STATIC = Path(__file__).resolve().parent / "static"
NO_STORE = {"Cache-Control": "no-store"}


def _to_json(doc: dict) -> bytes:
    try:
        text = json.dumps(doc, allow_nan=False, separators=(",", ":"))
    except ValueError:  # NaN or inf somewhere: browsers cannot parse those
        text = json.dumps(finite(doc), separators=(",", ":"))
    return text.encode()


class StateCache:
    """The newest good document, its JSON, and how the source has been doing."""

    def __init__(self, source: StateSource, refresh_s: float, timeout_s: float) -> None:
        self.source = source
        self.refresh_s = refresh_s
        self.timeout_s = timeout_s
        self.doc: dict = empty_state()
        self.body: bytes = _to_json(self.doc)
        self.error: str | None = None
        self.source_ok: bool | None = None  # None until the first snapshot returned or failed
        self.last_success: float | None = None  # time.monotonic() of the last good snapshot
        self.snapshots = 0
        self.failures = 0
        self.first_done = asyncio.Event()
        self._metrics: bytes | None = None

    async def refresh(self) -> None:
        """One snapshot: on success cache it, on failure keep the last good document plus the error."""
        try:
            async with asyncio.timeout(self.timeout_s):  # not wait_for: it can swallow a cancellation (3.11)
                doc = await self.source.snapshot()
            check_state(doc)
            body = _to_json(doc)
        except Exception as exc:  # any failure of the source is reported, never raised
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if error != self.error:
                logger.warning("state source failed: %s", error)
            self.failures += 1
            self.source_ok, self.error = False, error
            self.body = _to_json({**self.doc, "source_error": error})
        else:
            if self.source_ok is False:
                logger.info("state source recovered")
            self.snapshots += 1
            self.source_ok, self.error, self.last_success = True, None, time.monotonic()
            self.doc, self.body = doc, body
        self._metrics = None
        self.first_done.set()

    async def run(self) -> None:
        """Refresh every `refresh_s` (measured start to start) until cancelled."""
        while True:
            started = time.monotonic()
            await self.refresh()
            await asyncio.sleep(max(0.0, self.refresh_s - (time.monotonic() - started)))

    def metrics(self) -> bytes:
        if self._metrics is None:
            self._metrics = render_metrics(self.doc, source_ok=self.source_ok is not False)
        return self._metrics

    def health(self) -> dict:
        age = None if self.last_success is None else round(time.monotonic() - self.last_success, 3)
        return {
            "status": "ok",
            "source_ok": self.source_ok,
            "source_error": self.error,
            "last_success_age_s": age,
            "snapshots": self.snapshots,
            "failures": self.failures,
        }


def render_page(poll_ms: int) -> str:
    """index.html with style.css and the scripts inlined: one self-contained page, no other request."""
    page = (STATIC / "index.html").read_text(encoding="utf-8")
    scripts = "\n".join((STATIC / name).read_text(encoding="utf-8") for name in ("plots.js", "app.js"))
    page = page.replace("/*STYLE*/", (STATIC / "style.css").read_text(encoding="utf-8"))
    return page.replace("/*SCRIPT*/", scripts).replace("__POLL_MS__", str(poll_ms))


async def _not_found_or_not_allowed(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if request.url.path.startswith("/api/"):
        body = {"error": exc.detail, "status": exc.status_code, "path": request.url.path}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
    return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)


def create_app(source: StateSource, refresh_s: float = 1.0, snapshot_timeout_s: float = 30.0) -> Starlette:
    """The dashboard app over `source`, polled every `refresh_s` seconds (each snapshot may take up to
    `snapshot_timeout_s` before it counts as failed)."""
    if refresh_s <= 0:
        raise ValueError("refresh_s must be positive")
    cache = StateCache(source, refresh_s, snapshot_timeout_s)
    page = render_page(poll_ms=int(min(max(refresh_s, 0.25), 1.0) * 1000))

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers=NO_STORE)

    async def state(request: Request) -> Response:
        return Response(cache.body, media_type="application/json", headers=NO_STORE)

    async def metrics(request: Request) -> Response:
        return Response(cache.metrics(), media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)

    async def healthz(request: Request) -> Response:
        return JSONResponse(cache.health(), headers=NO_STORE)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(cache.run(), name="dashboard-refresh")
        with contextlib.suppress(TimeoutError):  # a slow source must not hold the server back for long
            async with asyncio.timeout(min(snapshot_timeout_s, 5.0)):
                await cache.first_done.wait()
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/api/v1/state", state, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    handlers = {404: _not_found_or_not_allowed, 405: _not_found_or_not_allowed}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.cache = cache
    return app
