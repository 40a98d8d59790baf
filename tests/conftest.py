"""Shared fixtures: real services (Kafka, Redis), fresh topics per test, an isolated Redis client.

Services come from the environment that ``epd services run`` exports (``EPD_KAFKA_BOOTSTRAP``,
``EPD_REDIS_URL``, ``EPD_KAFKA_IDEMPOTENCE``); when none answers, the ``settings`` fixture starts
a Tansu broker and/or a redis-server itself (``epd.services``) and stops them at session end.
Nothing starts unless a test asks for ``settings`` (directly or through another fixture), so pure
unit tests run without any service.

Redis: tests use DB ``$EPD_TEST_REDIS_DB`` (default 15), never DB 0, and each test's keys live
under its own prefix (``redis_prefix``) and are deleted afterwards. The DB is not flushed as a
whole because several test runs may share one Redis at the same time.
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

TEST_REDIS_DB = int(os.environ.get("EPD_TEST_REDIS_DB", "15"))
_INTEGRATION_DIR = Path(__file__).parent / "integration"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Everything under tests/integration is marked ``integration`` (select with -m)."""
    for item in items:
        if _INTEGRATION_DIR in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


def redis_url_with_db(url: str, db: int) -> str:
    """``url`` pointing at database ``db`` (the path part of a redis:// URL)."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


@pytest.fixture(scope="session")
def services_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[services.ServicesState]:
    """Kafka and Redis that answer: reused from the env / ``epd up`` state, else started here."""
    logs = tmp_path_factory.mktemp("services")
    try:
        # record=False: never write the shared state file; tie_to_parent: what we start dies
        # with this pytest process even if it is killed.
        state, started = services.up(None, record=False, log_dir=logs, tie_to_parent=True)
    except services.ServiceError as exc:
        pytest.fail(f"cannot provide Kafka/Redis for the tests: {exc}", pytrace=False)
    try:
        yield state
    finally:
        services.stop_records(started)


@pytest.fixture(scope="session")
def settings(services_state: services.ServicesState) -> Iterator[Settings]:
    """Settings pointing at the test broker and the test Redis DB; exported to ``os.environ``
    too, so code calling ``get_settings()`` and ``epd`` subprocesses see the same services."""
    env = dict(services_state.env)
    env["EPD_REDIS_URL"] = redis_url_with_db(env["EPD_REDIS_URL"], TEST_REDIS_DB)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        from runtime.settings import get_settings

        get_settings.cache_clear()
        yield Settings()
        get_settings.cache_clear()


@pytest.fixture
def topic_prefix() -> str:
    """A topic prefix no other test (or test run) uses."""
    return f"test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def topics(settings: Settings, topic_prefix: str) -> AsyncIterator[Topics]:
    """The six pipeline topics under a fresh prefix, created on the test broker."""
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
