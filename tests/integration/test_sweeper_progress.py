"""The sweep's view of the broker (consumers.sweeper.BrokerProgress), on the real broker: which
partitions each stage's consumer group has consumed to their end."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import GroupCoordinatorNotAvailableError

from consumers.sweeper import BrokerProgress, Progress
from runtime.kafka import make_consumer
from runtime.settings import Settings
from schemas.topics import Topics

pytestmark = pytest.mark.integration


async def _commit(settings: Settings, group: str, tp: TopicPartition, offset: int) -> None:
    """Commit ``offset`` for ``group`` on ``tp``, as a worker does once it handled a record."""
    consumer = make_consumer(settings, group_id=group)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: offset})
    finally:
        await consumer.stop()


async def _read(progress: BrokerProgress, timeout_s: float = 30.0) -> Progress:
    """One read; on a fresh broker the group coordinator comes up with the first group (a
    sweep pass that meets this fails and the next one tries again, as here)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await progress()
        except GroupCoordinatorNotAvailableError:
            assert time.monotonic() < deadline, "no group coordinator"
            await asyncio.sleep(0.5)


async def test_with_the_decode_stage_the_decode_groups_progress_is_read(
    topic_settings: Settings, topics: Topics
) -> None:
    cfg = topic_settings.model_copy(update={"decode_stage": True})
    producer = AIOKafkaProducer(bootstrap_servers=cfg.kafka_bootstrap)
    await producer.start()
    try:
        meta = await producer.send_and_wait(topics.decode, b"handoff", key=b"r1")
    finally:
        await producer.stop()
    tp = TopicPartition(topics.decode, meta.partition)

    progress = BrokerProgress(cfg)
    try:
        before = await _read(progress)
        assert before.partitions[topics.decode] == cfg.topic_partitions
        # Nothing committed on a partition holding a record: it may still be handled.
        assert meta.partition not in before.idle[topics.decode]
        assert not before.idle_for_key(topics.decode, "r1")

        await _commit(cfg, topics.group("decode"), tp, meta.offset + 1)
        after = await _read(progress)
        assert meta.partition in after.idle[topics.decode]
        assert after.idle_for_key(topics.decode, "r1")
    finally:
        await progress.close()

    # Without the decode stage the sweep does not ask about its topic at all.
    plain = BrokerProgress(topic_settings)
    try:
        assert topics.decode not in (await _read(plain)).partitions
    finally:
        await plain.close()
