"""Shared fixtures: real services (Kafka, Redis), fresh topics per test, an isolated Redis client.

Services come from one layer, ``tests/services.py``: environment (``EPD_KAFKA_BOOTSTRAP`` /
``EPD_REDIS_URL``), testcontainers when a Docker engine answers, else embedded processes;
``EPD_TEST_SERVICES`` forces one. The pytest header says which. Nothing starts unless a test asks
for ``settings`` (directly or through another fixture), so pure unit tests run without services.

Redis: tests use DB ``$EPD_TEST_REDIS_DB`` (default 15), never DB 0, and each test's keys live
under its own prefix (``redis_prefix``) and are deleted afterwards. The DB is not flushed as a
whole because several test runs may share one Redis at the same time (env mode). Tests on a
Redis Cluster ask for ``redis_cluster``: three masters of this session's own.

In a parallel run (``pytest -n N``, what ``make test`` runs) each xdist worker is a session:
its own services, its own cluster; the files start heaviest first (``tests/scheduling.py``).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from epd import services
from runtime.settings import Settings
from schemas.topics import Topics
from tests import scheduling
from tests import services as test_services_mod

TEST_REDIS_DB = int(os.environ.get("EPD_TEST_REDIS_DB", "15"))
_INTEGRATION_DIRS = (Path(__file__).parent / "integration", Path(__file__).parent / "fault")


def pytest_configure(config: pytest.Config) -> None:
    scheduling.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration and tests/fault is marked ``integration``; in an
    xdist worker, the heaviest files go first (``tests/scheduling.py``)."""
    for item in items:
        if any(d in Path(str(item.fspath)).parents for d in _INTEGRATION_DIRS):
            item.add_marker(pytest.mark.integration)
    scheduling.order(config, items)


def redis_url_with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db`` (the path part of a redis:// URL)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def pytest_report_header(config: pytest.Config) -> str:
    """``services: testcontainers (kafka=..., redis=...)`` and the like."""
    return test_services_mod.describe_planned()


@pytest.fixture(scope="session")
def test_services(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[test_services_mod.TestServices]:
    """The broker and Redis of this session (see tests/services.py); stopped at the end."""
    try:
        ts = test_services_mod.provide(tmp_path_factory.mktemp("services"))
    except (test_services_mod.ServicesUnavailable, services.ServiceError) as exc:
        pytest.fail(f"cannot provide Kafka/Redis for the tests: {exc}", pytrace=False)
    try:
        yield ts
    finally:
        ts.close()


@pytest.fixture(scope="session")
def settings(test_services: test_services_mod.TestServices) -> Iterator[Settings]:
    """Settings pointing at the test broker and the test Redis DB; exported to ``os.environ``
    too, so ``epd`` subprocesses (workers) see the same services."""
    env = dict(test_services.env)
    env["EPD_REDIS_URL"] = redis_url_with_db(env["EPD_REDIS_URL"], TEST_REDIS_DB)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        from runtime.settings import get_settings

        get_settings.cache_clear()
        yield Settings()
        get_settings.cache_clear()


@pytest.fixture(scope="session")
def redis_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[test_services_mod.RedisClusterHandle]:
    """A 3-master Redis Cluster (``redis-server --cluster-enabled yes`` processes formed by
    ``redis-cli --cluster create``) for this session; started the first time a test asks."""
    try:
        cluster = test_services_mod.redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    except test_services_mod.ServicesUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def topic_prefix() -> str:
    """A topic prefix no other test (or test run) uses."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def topics(settings: Settings, topic_prefix: str) -> AsyncIterator[Topics]:
    """Every topic of the channel table under a fresh prefix, created on the test broker."""
    from runtime.kafka import ensure_topics

    t = Topics(topic_prefix)
    await ensure_topics(settings, t.all())
    yield t
    # Tansu keeps every byte in memory: drop the topics so a long run does not grow without end.
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    with contextlib.suppress(Exception):
        await admin.start()
        await admin.delete_topics(t.all())
    with contextlib.suppress(Exception):
        await admin.close()


@pytest.fixture
def topic_settings(settings: Settings, topics: Topics) -> Settings:
    """``settings`` with ``topic_prefix`` set to the fresh ``topics`` prefix."""
    return settings.model_copy(update={"topic_prefix": topics.prefix})


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix owned by one test; ``redis_client`` deletes its keys afterwards."""
    return f"test:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def redis_client(settings: Settings, redis_prefix: str) -> AsyncIterator[object]:
    """``redis.asyncio.Redis`` on the test DB. Keys under ``redis_prefix`` are removed after."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(settings.redis_url)
    await client.ping()
    try:
        yield client
    finally:
        keys = [k async for k in client.scan_iter(match=f"{redis_prefix}*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
