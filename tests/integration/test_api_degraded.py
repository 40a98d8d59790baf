"""The API in-process (ASGI) with a dependency down: 503 with Retry-After, never a crash,
and an open API says so at start-up."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from frontend.api import create_app
from runtime.settings import Settings
from tests.integration.api_stack import free_port

pytestmark = pytest.mark.integration


@asynccontextmanager
async def in_process(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    if settings.ec_secret is None:  # the API refuses to start without one
        settings = settings.model_copy(update={"ec_secret": SecretStr(secrets.token_hex(16))})
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


async def test_redis_lost_during_a_submits_wait_answers_accepted_not_503(
    topic_settings: Settings, tmp_path: Path
) -> None:
    """A submit with ``?wait=`` was accepted, and Redis goes while it waits (no workers here,
    so it would wait): the answer is the plain 202 Accepted, never a 503, which a client
    would retry as a refusal and so enqueue the request twice."""
    import redis.asyncio as aioredis

    from epd import services

    redis_rec = services.start_redis(
        tmp_path, f"redis://127.0.0.1:{free_port()}/0", log_dir=tmp_path, tie_to_parent=True
    )
    # The topics exist (topic_settings): the submit is accepted, then waits for an end that
    # no worker brings.
    own = topic_settings.model_copy(update={"redis_url": redis_rec.address, "api_tokens": None})
    watcher = aioredis.Redis.from_url(redis_rec.address)
    try:
        async with in_process(own) as c:
            for _ in range(100):
                if c._transport.app.state.api.kafka_ready.is_set():  # type: ignore[attr-defined]
                    break
                await asyncio.sleep(0.1)
            body = {"prompt": "hi", "max_tokens": 1}
            waiting = asyncio.create_task(c.post("/v1/requests", json=body, params={"wait": 60}))
            pattern = f"{own.topic_prefix}:status:*"
            for _ in range(300):  # accepted: its record is written
                if [k async for k in watcher.scan_iter(pattern)]:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the submit was never accepted")
            await asyncio.sleep(0.3)  # now in its wait
            assert not waiting.done()
            services.stop_records([redis_rec])
            r = await asyncio.wait_for(waiting, 30)
    finally:
        await watcher.aclose()
        services.stop_records([redis_rec])
    assert r.status_code == 202, r.text
    assert r.json()["status"] in {"queued", "prefilling"} and "status_url" in r.json()


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


async def test_encode_backlog_beyond_the_bound_is_429(topic_settings: Settings) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    from frontend.api.admission import LagMonitor
    from runtime.kafka import make_consumer, make_producer
    from schemas.topics import Topics

    cfg = topic_settings.model_copy(update={"api_max_encode_lag": 3, "api_tokens": None})
    topics = Topics(cfg.topic_prefix)
    producer = make_producer(cfg)
    await producer.start()
    try:  # five encode events nobody consumes (no encode worker on this prefix)
        for i in range(5):
            await producer.send_and_wait(topics.encode, value=b"x", key=str(i).encode())
    finally:
        await producer.stop()
    consumer = make_consumer(cfg, group_id=topics.group("encode"))
    admin = AIOKafkaAdminClient(bootstrap_servers=cfg.kafka_bootstrap)
    await consumer.start()
    await admin.start()
    try:
        assert await LagMonitor(cfg, topics).sample(consumer, admin) == 5
    finally:
        await consumer.stop()
        await admin.close()

    async with in_process(cfg) as c:
        st = c._transport.app.state.api  # type: ignore[attr-defined]
        for _ in range(200):
            if st.kafka_ready.is_set() and st.lag.lag is not None:
                break
            await asyncio.sleep(0.05)
        assert st.lag.lag == 5
        r = await c.post("/v1/requests", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["rule"] == "admission.encode_lag"
        assert int(r.headers["Retry-After"]) >= 1


async def test_renders_are_bounded_and_never_stall_the_event_loop(
    topic_settings: Settings,
) -> None:
    import base64

    import redis.asyncio as aioredis

    from media.sample_images import png_bytes, synthetic_image

    cfg = topic_settings.model_copy(update={"api_render_concurrency": 1, "api_tokens": None})
    img = base64.b64encode(png_bytes(synthetic_image(512, 512, seed=5))).decode()
    body = {"prompt": "Big <image>", "images": [img], "max_tokens": 1}
    try:
        async with in_process(cfg) as c:
            st = c._transport.app.state.api  # type: ignore[attr-defined]
            for _ in range(200):
                if st.kafka_ready.is_set():
                    break
                await asyncio.sleep(0.05)
            await st.intake.render_slots.acquire()  # the one render slot is busy
            post = asyncio.create_task(c.post("/v1/requests", json=body))
            await asyncio.sleep(0.5)
            assert not post.done()  # waits for a slot instead of rendering beside it
            health = await asyncio.wait_for(c.get("/healthz"), 2)
            assert health.status_code == 200  # the loop keeps serving meanwhile
            st.intake.render_slots.release()
            # the render itself runs in a thread: the loop answers during it too
            t = asyncio.create_task(c.post("/v1/requests", json={**body, "max_tokens": 2}))
            pings = [await asyncio.wait_for(c.get("/healthz"), 2) for _ in range(5)]
            assert all(p.status_code == 200 for p in pings)
            assert (await post).status_code == 202 and (await t).status_code == 202
    finally:
        client = aioredis.Redis.from_url(cfg.redis_url)
        keys = [k async for k in client.scan_iter(match=f"{cfg.topic_prefix}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()
