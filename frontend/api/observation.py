"""Latency by route and HTTP requests in flight: a plain ASGI middleware.

Starlette's ``BaseHTTPMiddleware`` (what ``@app.middleware("http")`` builds) runs every
response through a memory stream and a task of its own; on a request path that costs a few
milliseconds in all, that was a visible share. This one only watches ``send`` for the
response's start.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from frontend.api.metrics import Metrics


class Observation:
    """Observes each HTTP request's latency to its response's start (what a client waits for
    before the first byte; a stream's body is not counted), labelled by method, route
    template and status, and keeps the in-flight gauge up to date."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics, t0 = self.metrics, time.perf_counter()
        observed = False

        def observe(code: int) -> None:
            nonlocal observed
            if observed:
                return
            observed = True
            metrics.http_in_flight.dec()
            # The router put the matched route into this scope (the same dict) on its way in.
            path = getattr(scope.get("route"), "path", "unmatched")
            metrics.latency.labels(scope["method"], path, str(code)).observe(
                time.perf_counter() - t0
            )

        async def watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                observe(int(message["status"]))
            await send(message)

        metrics.http_in_flight.inc()
        try:
            await self.app(scope, receive, watched)
        finally:
            observe(500)  # no response started: the server answers 500
