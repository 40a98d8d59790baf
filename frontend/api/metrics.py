"""Prometheus metrics of one API app (its own registry, so several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.requests import Request

from runtime.fleet.metrics import FleetMetrics


class Metrics:
    """The API's metrics; also the intake's observer (:class:`producers.intake.IntakeObserver`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "epd_api_requests",
            "submissions by API outcome (queued, duplicate, rejected, throttled, unavailable)",
            ["status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "epd_api_http_request_seconds",
            "HTTP latency by route",
            ["method", "route", "code"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "epd_api_in_flight", "admitted requests without an outcome", registry=self.registry
        )
        self.by_status = Gauge(
            "epd_api_unfinished_requests",
            "admitted, unfinished requests by status (all replicas; read at scrape time)",
            ["status"],
            registry=self.registry,
        )
        self.http_in_flight = Gauge(
            "epd_api_http_in_flight", "HTTP requests being handled", registry=self.registry
        )
        self.disconnects = Counter(
            "epd_api_client_disconnects",
            "clients gone before their answer, by route and when (body: while the API read "
            "the request body; wait: before a plain answer; stream: during a streamed one)",
            ["route", "phase"],
            registry=self.registry,
        )
        self.fleet = FleetMetrics(self.registry)
        self.render = Histogram(
            "epd_api_render_seconds",
            "render time (decode + image processor)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )

    def outcome(self, label: str) -> None:
        """One submission's outcome (``queued``, ``duplicate``, ``rejected``, a refusal)."""
        self.requests.labels(label).inc()

    def disconnected(self, route: str, phase: str) -> None:
        """A client that went away (``phase``: ``body`` or ``stream``) on ``route``."""
        self.disconnects.labels(route, phase).inc()

    def rendered(self, seconds: float) -> None:
        """One render's duration."""
        self.render.observe(seconds)


def client_gone(request: Request, phase: str) -> None:
    """Count a client that went away before its answer (``phase``: ``wait`` for a plain
    answer, ``stream`` for a streamed one) on the request's route, in the app's metrics."""
    metrics: Metrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        route = getattr(request.scope.get("route"), "path", "unmatched")
        metrics.disconnected(route, phase)
