"""The consume loop's parts on their own, against in-memory stand-ins: the record runner (which
holds no consumer), the dead-letter writer, and the opt-in lost-log guard."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError

from consumers.commits import CommitTracker
from consumers.config import ConsumerConfig
from consumers.dead_letters.writer import DeadLetterWriter
from consumers.loop import ConsumeLoop
from consumers.lost_logs import LostLogGuard
from consumers.metrics import metrics_for
from consumers.records import ConsumedEvent
from consumers.retry import Poison, RetryPolicy, default_is_infrastructure, default_is_transient
from consumers.runner import Classifier, RecordRunner
from consumers.stopping import Abandoned
from runtime.settings import Settings
from schemas import codec
from schemas.types import DeadLetter, ErrorInfo

TP = TopicPartition("in", 0)


@dataclass
class Rec:
    offset: int
    value: bytes
    topic: str = "in"
    partition: int = 0
    key: bytes | None = b"req-1"
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp: int = 0


@dataclass
class Producer:
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    fail_first: int = 0

    async def send_and_wait(self, topic: str, value: bytes, **_: Any) -> None:
        if self.fail_first:
            self.fail_first -= 1
            raise KafkaConnectionError("broker away")
        self.sent.append((topic, value))


def _writer(
    stop: asyncio.Event, producer: Producer, *, in_transaction: bool = False, hook: Any = None
) -> DeadLetterWriter:
    writer = DeadLetterWriter(
        group_id="g",
        dlq_topic="dlq",
        stop=stop,
        metrics=metrics_for(None),
        backoff_initial_s=0.001,
        backoff_max_s=0.002,
        in_transaction=in_transaction,
        on_dead_letter=hook,
    )
    writer.producer = producer  # type: ignore[assignment]
    return writer


def _runner(handler: Any, producer: Producer, stop: asyncio.Event | None = None) -> RecordRunner:
    stop = stop or asyncio.Event()
    return RecordRunner(
        handler,
        group_id="g",
        decode=lambda b: b,
        classify=Classifier(default_is_transient, default_is_infrastructure),
        policy=RetryPolicy(max_attempts=3, backoff_initial_s=0.001, backoff_max_s=0.002),
        dead_letters=_writer(stop, producer),
        max_message_bytes=1000,
        stop=stop,
        metrics=metrics_for(None),
    )


async def test_the_runner_retries_a_transient_failure_then_succeeds() -> None:
    attempts: list[int] = []

    async def handler(ce: ConsumedEvent) -> None:
        attempts.append(ce.attempt)
        if ce.attempt < 3:
            raise RuntimeError("flaky")

    producer = Producer()
    runner = _runner(handler, producer)
    assert await runner.run(Rec(5, b"x")) is True
    assert attempts == [1, 2, 3] and (runner.processed, runner.retried) == (1, 2)
    assert producer.sent == []


async def test_the_runner_dead_letters_poison_and_oversize_and_says_done() -> None:
    reported: list[tuple[int, str]] = []

    async def handler(ce: ConsumedEvent) -> None:
        raise Poison("bad", code="rejected", rule="r")

    async def hook(ce: ConsumedEvent, info: ErrorInfo) -> None:
        reported.append((ce.offset, info.code))

    producer = Producer()
    stop = asyncio.Event()
    runner = _runner(handler, producer, stop)
    runner.dead_letters = _writer(stop, producer, hook=hook)
    assert await runner.run(Rec(1, b"x")) is True
    assert await runner.run(Rec(2, b"y" * 1001)) is True
    assert reported == [(1, "rejected"), (2, "oversize")]
    letters = [codec.decode(v, DeadLetter) for _, v in producer.sent]
    assert [(lt.offset, lt.error.code, lt.attempts) for lt in letters] == [
        (1, "rejected", 1),
        (2, "oversize", 0),
    ]
    assert runner.dead_letters.dead_lettered == 2


async def test_a_pending_retry_is_abandoned_when_the_loop_stops() -> None:
    stop = asyncio.Event()

    async def handler(ce: ConsumedEvent) -> None:
        stop.set()
        raise RuntimeError("flaky")

    runner = _runner(handler, Producer(), stop)
    assert await runner.run(Rec(1, b"x")) is False  # the offset must stay uncommitted


async def test_the_writer_retries_a_broker_error_but_abandons_it_in_a_transaction() -> None:
    ce = ConsumedEvent("in", 0, 3, b"k", {}, b"v", None)
    info = ErrorInfo("rejected", "no")
    producer = Producer(fail_first=2)
    await _writer(asyncio.Event(), producer).write(ce, info, attempts=1)
    assert len(producer.sent) == 1
    with pytest.raises(Abandoned):
        await _writer(asyncio.Event(), Producer(fail_first=1), in_transaction=True).write(
            ce, info, attempts=1
        )


class Consumer:
    def __init__(self, high: int, start: int = 0) -> None:
        self.high = high
        self.start = start
        self.seeks: list[tuple[TopicPartition, int]] = []

    def assignment(self) -> set[TopicPartition]:
        return {TP, TopicPartition("in", 1)}

    def highwater(self, tp: TopicPartition) -> int | None:
        return self.high if tp == TP else None

    async def position(self, tp: TopicPartition) -> int:
        return 0

    async def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self.start for tp in tps}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))


async def test_the_guard_reads_a_lost_topic_again_from_the_start_and_commits_that() -> None:
    tracker: CommitTracker[TopicPartition] = CommitTracker()
    for off in range(10, 20):
        tracker.add(TP, off)
    commits: list[dict[TopicPartition, int]] = []

    async def commit(offsets: dict[TopicPartition, int]) -> bool:
        commits.append(dict(offsets))
        return True

    remade: list[str] = []

    async def remake() -> None:
        # The topics are made before the rewind's commit lands on the new log.
        remade.append(f"after {len(commits)} commits")

    guard = LostLogGuard("g", tracker, commit, remake)
    consumer = Consumer(high=3)  # the log ends at 3, this member read up to 20
    await guard.after_poll(consumer)  # type: ignore[arg-type]
    both = {TP, TopicPartition("in", 1)}
    assert set(consumer.seeks) == {(tp, 0) for tp in both}  # the whole topic, from its start
    assert commits == [{tp: 0 for tp in both}]
    assert guard.rewinds == 1 and tracker.next_offset(TP) is None
    assert remade == ["after 0 commits"]  # the pipeline's topics made again, once
    later = Consumer(high=25)
    await guard.after_poll(later)  # type: ignore[arg-type]
    assert later.seeks == [] and len(commits) == 1  # whole again: nothing more to do
    assert len(remade) == 1


async def test_a_guard_that_cannot_make_the_topics_again_still_rewinds() -> None:
    """The broker refusing to make the topics (still starting) is logged; the lost log is
    read again from the start all the same."""
    tracker: CommitTracker[TopicPartition] = CommitTracker()
    tracker.add(TP, 10)

    async def commit(offsets: dict[TopicPartition, int]) -> bool:
        return True

    async def refused() -> None:
        raise ConnectionError("the broker is still starting")

    guard = LostLogGuard("g", tracker, commit, refused)
    consumer = Consumer(high=3)
    await guard.after_poll(consumer)  # type: ignore[arg-type]
    assert {tp for tp, _ in consumer.seeks} == {TP, TopicPartition("in", 1)}


def test_the_guard_is_refused_with_transactions() -> None:
    config = ConsumerConfig(topics=["in"], group_id="g", dlq_topic="dlq")

    async def handler(ce: ConsumedEvent) -> None:
        pass

    settings = Settings(kafka_transactions=True, kafka_idempotence=True)
    with pytest.raises(ValueError, match="needs interval commits"):
        ConsumeLoop(settings, config, handler, rewind_lost_logs=True)
