"""The shared Redis client (runtime/redis/client.py) under a burst, against a real Redis."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
import torch
from redis.exceptions import MaxConnectionsError

from runtime.redis.client import redis_client as make_redis_client
from runtime.settings import Settings
from runtime.status import StatusStore
from runtime.stores.redis import RedisStore
from schemas.types import ResultEvent
from tests import services as layer

pytestmark = pytest.mark.integration

BURST = 300
POOL = 4


def _burst() -> list[ResultEvent]:
    # Mostly distinct requests (one WATCHed connection each), plus several updates per request
    # so WATCH conflicts and retries happen under the same pressure.
    return [
        ResultEvent(f"r{i % 100}", "stage", ("queued", "encoding", "prefilling")[i // 100])
        for i in range(BURST)
    ]


async def test_burst_of_status_applies_waits_for_a_connection(
    settings: Settings, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    small = settings.model_copy(update={"redis_max_connections": POOL})
    client = make_redis_client(small)
    status = StatusStore(client, prefix=redis_prefix.rstrip(":"), ttl_s=60)
    try:
        # start: the burst makes its records, as the router's first updates do
        results = await asyncio.gather(*(status.start(ev) for ev in _burst()))
        assert all(results)  # every (stage, status) pair was new: none lost, none failed
        pool = client.connection_pool
        opened = len(pool._available_connections) + len(pool._in_use_connections)
        assert 0 < opened <= POOL  # bounded: the burst waited instead of opening more
        recs = await asyncio.gather(*(status.get(f"r{i}") for i in range(100)))
        assert all(r is not None and r.status == "prefilling" for r in recs)
    finally:
        await client.aclose()


async def test_default_pool_of_that_size_fails_the_same_burst(
    settings: Settings, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    # The failure this module exists for: redis-py's default pool raises at its limit.
    client = aioredis.Redis.from_url(settings.redis_url, max_connections=POOL)
    status = StatusStore(client, prefix=redis_prefix.rstrip(":"), ttl_s=60)
    try:
        outcomes = await asyncio.gather(
            *(status.start(ev) for ev in _burst()), return_exceptions=True
        )
        assert any(isinstance(o, MaxConnectionsError) for o in outcomes)
    finally:
        await client.aclose()


async def test_store_on_redis_py_waits_for_a_connection_too(
    settings: Settings, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    # The same class of failure in the embedding store's redis-py path (rediss://, or URLs with
    # redis-py-only options such as max_connections).
    url = f"{settings.redis_url}?max_connections={POOL}&key_prefix={redis_prefix}"
    store = RedisStore(url, wire_io=False)
    try:
        tensors = [torch.full((4,), float(i)) for i in range(BURST)]
        await asyncio.gather(*(store.put(f"k{i}", t, 60) for i, t in enumerate(tensors)))
        got = await asyncio.gather(*(store.get(f"k{i}") for i in range(BURST)))
        assert all(torch.equal(g, t) for g, t in zip(got, tensors, strict=True))
    finally:
        await store.close()


async def test_status_updates_survive_connections_redis_dropped(
    settings: Settings, redis_client: aioredis.Redis, redis_prefix: str
) -> None:
    # What a Redis restart leaves in a pool: connections the server has closed. redis-py does
    # not retry a WATCH on one, so the status store takes a fresh connection itself.
    client = make_redis_client(settings)
    status = StatusStore(client, prefix=redis_prefix.rstrip(":"), ttl_s=60)
    try:
        ids = [f"dropped-{i}" for i in range(4)]
        # four pooled connections, all in use at once, then all idle in the pool
        await asyncio.gather(*(status.start(ResultEvent(r, "api", "queued")) for r in ids))
        killed = await redis_client.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1
        done = await asyncio.gather(
            *(status.apply(ResultEvent(r, "fanout", "encoding")) for r in ids)
        )
        assert all(done)
        assert [getattr(await status.get(r), "status", None) for r in ids] == ["encoding"] * 4
    finally:
        await client.aclose()


async def test_a_command_waits_out_a_freeze_longer_than_redis_pys_default(
    settings: Settings, test_services: layer.TestServices, redis_prefix: str
) -> None:
    """redis-py 8 gives up on an answer after 5 s by default: a Redis frozen that long failed
    requests that only had to wait (the frozen-Redis fault test, now and then). The shared
    client waits ``EPD_REDIS_SOCKET_TIMEOUT_S`` (30 s)."""
    handle = test_services.redis
    if not handle.controllable or handle.pause is None or handle.unpause is None:
        pytest.skip(f"Redis is not ours to freeze in mode {test_services.mode}")
    pause, unpause = handle.pause, handle.unpause
    client = make_redis_client(settings)
    try:
        await client.ping()
        await asyncio.to_thread(pause)
        try:
            sent = asyncio.create_task(client.set(f"{redis_prefix}frozen", "1", ex=60))
            await asyncio.sleep(6.0)  # past redis-py's own 5 s
            assert not sent.done(), sent
        finally:
            await asyncio.to_thread(unpause)
        assert await asyncio.wait_for(sent, 20) is True
    finally:
        await client.aclose()
