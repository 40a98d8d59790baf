"""What the API's handlers share: connections, the renderer and fan-out, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from producers.api.admission import LagMonitor
from producers.api.idempotency import IdempotencyStore
from producers.fanout import FanOut
from producers.render import Renderer
from runtime.kafka import KafkaPublisher
from runtime.settings import Settings
from runtime.status_store import StatusNotifier, StatusStore
from schemas.topics import Topics

log = logging.getLogger("epd.api")


@dataclass
class ApiState:
    """Everything the handlers share (one per process)."""

    settings: Settings
    topics: Topics
    redis: aioredis.Redis
    status: StatusStore
    notifier: StatusNotifier
    idempotency: IdempotencyStore
    renderer: Renderer
    fanout: FanOut
    lag: LagMonitor
    tenants: dict[str, str]
    render_slots: asyncio.Semaphore
    publisher: KafkaPublisher
    kafka_ready: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)


class Metrics:
    """Prometheus metrics of one app (own registry, so several apps can live in one process)."""

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
        self.render = Histogram(
            "epd_api_render_seconds",
            "render time (decode + image processor)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )


def tenant_salt(tenant: str | None, salt: str | None) -> str | None:
    """The cache salt a request runs with: the tenant's own namespace, then the client's salt.

    Tenants therefore never share encoder-cache entries, whatever salt they send. JSON framing
    keeps the pair unambiguous (tenant "a" with salt "b:c" never meets tenant "a:b").
    """
    if tenant is None:
        return salt
    return "tenant:" + json.dumps([tenant, salt])


async def connect_kafka(st: ApiState) -> None:
    """Start the producers, retrying with backoff until the broker answers."""
    delay = 0.5
    while True:
        try:
            await st.publisher.start()
            st.kafka_ready.set()
            log.info("connected to Kafka at %s", st.settings.kafka_bootstrap)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("Kafka not reachable yet (%s); retrying in %.1fs", exc, delay)
            with contextlib.suppress(Exception):
                await st.publisher.stop()
            st.publisher = KafkaPublisher.for_pipeline(st.settings, st.topics)
            st.fanout.publisher = st.publisher
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
