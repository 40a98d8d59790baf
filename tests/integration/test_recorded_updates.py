"""The results collector folds only what a stage could not write through itself.

A stage that wrote an update to the status record sends it with ``epd-recorded``; the collector
(the real ``results`` stage, consume loop and all, on a real broker and Redis) decodes it and
leaves the record alone, and folds an update sent without it (a stage whose Redis write failed).
A record with the header is still decoded: a poison one goes to the dead letters, never
skipped unread. A stage's reporter puts the header on exactly the updates its record took.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis

from consumers.dead_letters.reader import read_dead_letters
from epd.stages import run_worker
from runtime.kafka import KafkaPublisher, ensure_topics, make_producer, read_topic
from runtime.reporting import RECORDED, RECORDED_HEADER, ResultReporter
from runtime.settings import Settings
from runtime.status import StatusStore
from schemas.topics import Topics
from schemas.types import ResultEvent

pytestmark = pytest.mark.integration

GUARD_S = 60.0


async def _until(pred: Callable[[], Awaitable[bool]], what: str) -> None:
    end = asyncio.get_running_loop().time() + GUARD_S
    while not await pred():
        if asyncio.get_running_loop().time() > end:
            pytest.fail(f"gave up waiting for: {what}")
        await asyncio.sleep(0.1)


@pytest.fixture
async def collector(
    settings: Settings,
) -> AsyncIterator[tuple[Settings, Topics, StatusStore, KafkaPublisher]]:
    cfg = settings.model_copy(
        update={"topic_prefix": f"test-recorded-{uuid.uuid4().hex[:10]}", "sweep_interval_s": 0.0}
    )
    topics = Topics(cfg.topic_prefix)
    await ensure_topics(cfg, topics.all())
    assigned = asyncio.Event()

    async def ready() -> None:
        assigned.set()

    worker = asyncio.create_task(run_worker("results", cfg, ready=ready))
    producer = make_producer(cfg)
    await producer.start()
    client = aioredis.Redis.from_url(cfg.redis_url)
    try:
        await asyncio.wait_for(assigned.wait(), GUARD_S)
        yield cfg, topics, StatusStore.for_settings(client, cfg), KafkaPublisher(producer)
    finally:
        await producer.stop()
        await client.aclose()
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker


async def test_the_collector_folds_only_updates_no_stage_recorded(
    collector: tuple[Settings, Topics, StatusStore, KafkaPublisher],
) -> None:
    cfg, topics, status, pub = collector
    rid = uuid.uuid4().hex
    assert await status.create(rid, {"tenant": "t"})
    # Marked recorded, though the record never took it: the collector must leave it alone.
    said = ResultEvent(rid, "encode", "encoding", info={"said": "recorded"})
    await pub.send(topics.results, rid, said, headers=[RECORDED])
    # A poison record with the header is decoded all the same: it is dead-lettered.
    await pub.producer.send_and_wait(
        topics.results, b"not avro", key=rid.encode(), headers=[RECORDED]
    )
    # Unmarked (a stage whose write-through failed): the collector folds it.
    missed = ResultEvent(rid, "prefill", "prefilling", info={"said": "missed"})
    await pub.send(topics.results, rid, missed)

    async def folded() -> bool:
        rec = await status.get(rid)
        return rec is not None and rec.status == "prefilling"

    await _until(folded, "the unrecorded update in the record")
    rec = await status.get(rid)
    assert rec is not None and rec.info.get("said") == "missed"
    assert "encode:encoding" not in rec.stages  # the recorded one was not folded again
    letters = await read_dead_letters(cfg, topics.dlq, timeout_s=GUARD_S)
    assert [r.letter.error.code for r in letters if r.letter is not None] == ["undecodable"]


async def test_a_reporter_marks_exactly_the_updates_its_record_took(
    settings: Settings, topic_settings: Settings, topics: Topics
) -> None:
    client = aioredis.Redis.from_url(settings.redis_url)
    status = StatusStore(client, prefix=topic_settings.topic_prefix)
    pub = KafkaPublisher.for_pipeline(topic_settings, topics)
    await pub.start()
    try:
        took, gone = uuid.uuid4().hex, uuid.uuid4().hex
        assert await status.create(took, {"tenant": "t"})
        report = ResultReporter(pub, topics.results, "prefill", "w", record=status.apply)
        await report(took, "prefilling")
        await report(gone, "prefilling")  # no record: not taken, so not marked
    finally:
        await pub.stop()
        await client.aclose()
    marks = {
        rec.key.decode(): dict(rec.headers).get(RECORDED_HEADER)
        for rec in await read_topic(topic_settings, topics.results)
    }
    assert marks == {took: b"1", gone: None}
