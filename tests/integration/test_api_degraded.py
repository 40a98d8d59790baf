"""The API in-process (ASGI) with a dependency down: 503 with Retry-After, never a crash,
and an open API says so at start-up."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from producers.api import create_app
from runtime.settings import Settings
from tests.integration.api_stack import free_port

pytestmark = pytest.mark.integration


@asynccontextmanager
async def in_process(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            yield client


def _unavailable(r: httpx.Response, rule: str) -> None:
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable"
    assert r.json()["error"]["rule"] == rule
    assert int(r.headers["Retry-After"]) >= 1


async def test_redis_down_is_503_and_open_api_is_announced(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    dead = settings.model_copy(
        update={
            "redis_url": f"redis://127.0.0.1:{free_port()}/0",
            "api_tokens": None,
            "topic_prefix": "degraded-redis",
        }
    )
    with caplog.at_level(logging.WARNING, logger="epd.api"):
        async with in_process(dead) as c:
            # wait for the Kafka connection, so the failure below is Redis's alone
            for _ in range(100):
                if c._transport.app.state.api.kafka_ready.is_set():  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.1)
            r = await c.post("/v1/requests", json={"prompt": "hi", "max_tokens": 1})
            _unavailable(r, "redis")
            _unavailable(await c.get("/v1/requests/abc"), "redis")
            _unavailable(
                await c.post(
                    "/v1/requests",
                    json={"prompt": "hi"},
                    headers={"Idempotency-Key": "k1"},
                ),
                "redis",
            )
            ready = await c.get("/readyz")
            assert ready.status_code == 503 and ready.json()["checks"]["redis"] != "ok"
            assert (await c.get("/healthz")).status_code == 200
    assert "API is OPEN" in caplog.text


async def test_kafka_down_is_503_until_it_connects(settings: Settings) -> None:
    dead = settings.model_copy(
        update={"kafka_bootstrap": f"127.0.0.1:{free_port()}", "topic_prefix": "degraded-kafka"}
    )
    async with in_process(dead) as c:
        _unavailable(await c.post("/v1/requests", json={"prompt": "hi"}), "kafka")
        ready = await c.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["kafka"] == "not connected"
        # reads need Redis only
        assert (await c.get("/v1/requests/unknown")).status_code == 404
