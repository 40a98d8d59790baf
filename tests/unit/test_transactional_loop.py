"""The transactional consume loop's batch barrier, against in-memory stand-ins for the clients.

Pure sequencing logic (which call comes when); the broker's side of transactions is tested on a
real Apache Kafka in tests/integration/test_transactions.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import TopicPartition

from consumers.config import ConsumerConfig
from consumers.loop import ConsumeLoop
from consumers.records import ConsumedEvent
from runtime.settings import Settings

TP = TopicPartition("in", 0)


@dataclass
class Rec:
    topic: str
    partition: int
    offset: int
    value: bytes
    key: bytes | None = None
    headers: tuple[()] = ()
    timestamp: int = 0


class FakeTxnManager:
    transactional_id = "test-txn"

    def __init__(self, owner: FakeProducer) -> None:
        self.owner = owner

    def is_in_transaction(self) -> bool:
        return self.owner.open


@dataclass
class FakeProducer:
    calls: list[tuple[str, Any]] = field(default_factory=list)
    open: bool = False

    def __post_init__(self) -> None:
        self._txn_manager = FakeTxnManager(self)

    async def begin_transaction(self) -> None:
        assert not self.open
        self.open = True
        self.calls.append(("begin", None))

    async def send_and_wait(self, topic: str, value: bytes, **_: Any) -> None:
        assert self.open, "a send outside a transaction"
        self.calls.append(("send", value))

    async def send_offsets_to_transaction(self, offsets: dict, group_id: str) -> None:
        assert self.open
        self.calls.append(("offsets", dict(offsets)))

    async def commit_transaction(self) -> None:
        self.open = False
        self.calls.append(("commit", None))

    async def abort_transaction(self) -> None:
        self.open = False
        self.calls.append(("abort", None))


class FakeConsumer:
    def __init__(self, batches: list[list[Rec]]) -> None:
        self.batches = batches
        self.seeks: list[tuple[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def paused(self) -> set[TopicPartition]:
        return set()

    def highwater(self, tp: TopicPartition) -> int | None:
        return None

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    async def getmany(self, timeout_ms: int, max_records: int) -> dict:
        if self.batches:
            return {TP: self.batches.pop(0)}
        await asyncio.sleep(timeout_ms / 1000)
        return {}

    async def stop(self) -> None:
        pass


def _loop(handler: Any, consumer: FakeConsumer, producer: FakeProducer) -> ConsumeLoop:
    settings = Settings(kafka_transactions=True, kafka_idempotence=True)
    config = ConsumerConfig(
        topics=["in"], group_id="g", dlq_topic="dlq", poll_timeout_ms=10, shutdown_timeout_s=0.2
    )
    loop = ConsumeLoop(settings, config, handler, decode=lambda b: b, producer=producer)  # type: ignore[arg-type]
    loop._attach(consumer)  # type: ignore[arg-type]  # as start() does with a started consumer
    return loop


async def test_a_batch_commits_its_outputs_with_its_offsets_after_every_handler() -> None:
    producer = FakeProducer()
    consumer = FakeConsumer([[Rec("in", 0, 5, b"a"), Rec("in", 0, 6, b"b"), Rec("in", 0, 7, b"c")]])
    release = asyncio.Event()

    async def handler(ce: ConsumedEvent) -> None:
        if ce.value == b"a":
            await release.wait()  # the slowest handler holds the commit back
        await producer.send_and_wait("out", value=ce.value)

    loop = _loop(handler, consumer, producer)
    run = asyncio.create_task(loop.run_forever())
    await asyncio.sleep(0.1)
    assert ("commit", None) not in producer.calls  # b and c are done, a is not: no commit yet
    release.set()
    for _ in range(100):
        if loop.transactions_committed:
            break
        await asyncio.sleep(0.02)
    loop.request_stop()
    await run
    kinds = [c[0] for c in producer.calls]
    assert kinds == ["begin", "send", "send", "send", "offsets", "commit"]
    assert producer.calls[4][1] == {TP: 8}
    assert consumer.seeks == []


async def test_a_batch_with_an_abandoned_handler_is_aborted_and_fetched_again() -> None:
    producer = FakeProducer()
    consumer = FakeConsumer([[Rec("in", 0, 3, b"x"), Rec("in", 0, 4, b"hang")]])

    async def handler(ce: ConsumedEvent) -> None:
        await producer.send_and_wait("out", value=ce.value)
        if ce.value == b"hang":
            await asyncio.Event().wait()  # never ends: cancelled at shutdown

    loop = _loop(handler, consumer, producer)
    run = asyncio.create_task(loop.run_forever())
    await asyncio.sleep(0.1)
    loop.request_stop()
    await run
    kinds = [c[0] for c in producer.calls]
    assert kinds == ["begin", "send", "send", "abort"]  # the outputs of x go with the batch
    assert consumer.seeks == [(TP, 3)]  # the whole batch comes again, x included
    assert loop.transactions_aborted == 1 and loop.transactions_committed == 0


def test_transactions_refuse_a_plain_producer_and_idempotence_off() -> None:
    config = ConsumerConfig(topics=["in"], group_id="g", dlq_topic="dlq")

    async def handler(ce: ConsumedEvent) -> None:
        pass

    plain = object()
    with pytest.raises(ValueError, match="must be transactional"):
        ConsumeLoop(
            Settings(kafka_transactions=True, kafka_idempotence=True),
            config,
            handler,
            producer=plain,
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="EPD_KAFKA_IDEMPOTENCE=true"):
        ConsumeLoop(Settings(kafka_transactions=True, kafka_idempotence=False), config, handler)
