"""ConsumeLoop against a real broker (the suite's Tansu, or whatever EPD_KAFKA_BOOTSTRAP names)."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client import CollectorRegistry

from consumers.config import ConsumerConfig
from consumers.loop import ConsumeLoop
from consumers.records import ConsumedEvent
from consumers.retry import Poison
from runtime.kafka import KafkaPublisher, ensure_topics, make_producer
from runtime.settings import Settings
from runtime.stores import StoreUnavailable
from schemas.codec import decode
from schemas.errors import ValidationError
from schemas.types import DeadLetter, ErrorInfo, ResultEvent

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """The suite's broker (tests/conftest.py), with one partition per new topic by default."""
    return settings.model_copy(update={"topic_partitions": 1})


async def _topics(settings: Settings, partitions: int = 1) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:10]
    src, dlq = f"rt-{tag}.in", f"rt-{tag}.dlq"
    await ensure_topics(settings, [src, dlq], partitions=partitions)
    return src, dlq


def _config(src: str, dlq: str, **kw: object) -> ConsumerConfig:
    base: dict[str, object] = {
        "topics": [src],
        "group_id": f"g-{uuid.uuid4().hex[:8]}",
        "dlq_topic": dlq,
        "backoff_initial_s": 0.01,
        "backoff_max_s": 0.05,
        "commit_interval_s": 0.05,
        "poll_timeout_ms": 100,
        # Tansu holds a JoinGroup for about half the session timeout: keep joins quick.
        "consumer_overrides": {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
    }
    base.update(kw)
    return ConsumerConfig(**base)  # type: ignore[arg-type]


async def _produce(settings: Settings, topic: str, values: list[str | bytes]) -> None:
    """One event per string (a ResultEvent with that request id), raw bytes as they are."""
    producer = make_producer(settings)
    await producer.start()
    try:
        for v in values:
            if isinstance(v, bytes):
                await producer.send_and_wait(topic, value=v, key=b"raw")
            else:
                await KafkaPublisher(producer).send(topic, v, ResultEvent(v, "test", "completed"))
    finally:
        await producer.stop()


async def _until(pred: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Wait for a condition (a generous cap against hangs, not a timing assertion)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s
    while not pred():
        if loop.time() > end:
            pytest.fail(f"gave up waiting for: {what}")
        await asyncio.sleep(0.02)


async def _committed(settings: Settings, group: str, tp: TopicPartition) -> int | None:
    c = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, group_id=group)
    await c.start()
    try:
        return await c.committed(tp)
    finally:
        await c.stop()


async def _read_dlq(settings: Settings, topic: str, n: int) -> list[tuple[DeadLetter, dict]]:
    c = AIOKafkaConsumer(
        topic, bootstrap_servers=settings.kafka_bootstrap, auto_offset_reset="earliest"
    )
    await c.start()
    out: list[tuple[DeadLetter, dict]] = []
    try:
        async with asyncio.timeout(60):
            while len(out) < n:
                batch = await c.getmany(timeout_ms=500)
                for recs in batch.values():
                    for r in recs:
                        out.append((decode(r.value, DeadLetter), dict(r.headers)))
    finally:
        await c.stop()
    return out


def _run(loop: ConsumeLoop) -> asyncio.Task[None]:
    return asyncio.create_task(loop.run_forever())


async def test_out_of_order_completion_commits_in_order(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, [f"r{i}" for i in range(10)])
    gates = {i: asyncio.Event() for i in range(10)}
    finished: list[int] = []

    async def handler(ce: ConsumedEvent) -> None:
        if ce.offset < 5:
            await gates[ce.offset].wait()
        finished.append(ce.offset)

    loop = ConsumeLoop(settings, _config(src, dlq, commit_interval_s=3600), handler)
    await loop.start()
    commits: list[int] = []
    real_commit = loop.consumer.commit

    async def spy(offsets: dict[TopicPartition, int]) -> None:
        for off in offsets.values():
            assert all(o in finished for o in range(off)), f"commit {off} skips unfinished work"
            commits.append(off)
        await real_commit(offsets)

    loop.consumer.commit = spy  # type: ignore[method-assign]
    task = _run(loop)
    tp = TopicPartition(src, 0)
    await _until(lambda: len(finished) == 5, "offsets 5..9 to finish")
    assert await loop.commit() == {}, "offset 0 still runs: there is no progress to commit"
    for i in (4, 3, 2):
        gates[i].set()
    await _until(lambda: len(finished) == 8, "offsets 2..4 to finish")
    assert await loop.commit() == {}, "offset 0 still runs: the commit may not move"
    gates[0].set()
    await _until(lambda: 0 in finished, "offset 0")
    assert await loop.commit() == {tp: 1}
    gates[1].set()
    await _until(lambda: len(finished) == 10, "everything")
    assert await loop.commit() == {tp: 10}
    assert finished[:5] == [5, 6, 7, 8, 9] and finished != sorted(finished)
    assert commits == [1, 10]
    await loop.stop()
    await task
    assert await _committed(settings, loop.config.group_id, tp) == 10


async def test_undecodable_event_goes_to_dlq(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["a", b"\x00garbage-not-avro", "b"])
    seen: list[str] = []
    hooked: list[tuple[int, str]] = []

    async def handler(ce: ConsumedEvent) -> None:
        seen.append(ce.event.request_id)

    async def on_dead(ce: ConsumedEvent, info: ErrorInfo) -> None:
        hooked.append((ce.offset, info.code))

    loop = ConsumeLoop(settings, _config(src, dlq), handler, on_dead_letter=on_dead)
    task = _run(loop)
    await _until(lambda: len(seen) == 2 and loop.dead_lettered == 1, "2 processed + 1 DLQ")
    await loop.stop()
    await task
    assert seen == ["a", "b"]
    assert hooked == [(1, "undecodable")]
    [(letter, headers)] = await _read_dlq(settings, dlq, 1)
    assert (letter.original_topic, letter.partition, letter.offset) == (src, 0, 1)
    assert letter.key == b"raw" and letter.value == b"\x00garbage-not-avro"
    assert letter.error.code == "undecodable"
    assert letter.consumer_group == loop.config.group_id
    assert headers["epd-error-code"] == b"undecodable"
    assert headers["epd-error-original-offset"] == b"1"
    assert headers["epd-schema"] == b"epd.DeadLetter"
    assert await _committed(settings, loop.config.group_id, TopicPartition(src, 0)) == 3


async def test_transient_failure_retries_then_succeeds(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["flaky"])
    attempts: list[int] = []

    async def handler(ce: ConsumedEvent) -> None:
        attempts.append(ce.attempt)
        if ce.attempt < 3:
            raise StoreUnavailable("redis is restarting")

    loop = ConsumeLoop(settings, _config(src, dlq, max_attempts=3), handler)
    assert not loop.assigned.is_set()
    task = _run(loop)
    await asyncio.wait_for(loop.assigned.wait(), 30)  # readiness: partitions held
    await _until(lambda: loop.processed == 1, "the third attempt to succeed")
    await loop.stop()
    await task
    assert attempts == [1, 2, 3]
    assert (loop.retried, loop.dead_lettered) == (2, 0)


async def test_stray_cancelled_error_is_a_failure_not_a_stall(settings: Settings) -> None:
    # A handler that awaits a future someone else cancelled sees CancelledError while its own
    # task is not being cancelled. That must be retried like any failure and the offset
    # committed afterwards, not silently left open (which would stall the partition).
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["awaits-a-cancelled-future"])
    attempts: list[int] = []

    async def handler(ce: ConsumedEvent) -> None:
        attempts.append(ce.attempt)
        if ce.attempt == 1:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            fut.cancel()
            await fut

    loop = ConsumeLoop(settings, _config(src, dlq, max_attempts=3), handler)
    task = _run(loop)
    await _until(lambda: loop.processed == 1, "the retry to succeed")
    await loop.stop()
    await task
    assert attempts == [1, 2]
    assert (loop.retried, loop.dead_lettered) == (1, 0)


async def test_permanent_and_exhausted_failures_go_to_dlq(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["always-down", "poison", "invalid", "fine"])
    calls: dict[str, int] = {}

    async def handler(ce: ConsumedEvent) -> None:
        rid = ce.event.request_id
        calls[rid] = calls.get(rid, 0) + 1
        if rid == "always-down":
            # a handler error, not an outage: max_attempts tries (outages get a time budget:
            # test_a_store_outage_longer_than_the_attempts_is_outlived)
            raise RuntimeError("handler keeps failing")
        if rid == "poison":
            raise Poison("deadline passed", code="expired")
        if rid == "invalid":
            raise ValidationError("ec-params", "metadata-only item", modality="image", item=1)

    loop = ConsumeLoop(settings, _config(src, dlq, max_attempts=3), handler)
    task = _run(loop)
    await _until(lambda: loop.dead_lettered == 3 and loop.processed == 1, "3 DLQ + 1 ok")
    await loop.stop()
    await task
    assert calls == {"always-down": 3, "poison": 1, "invalid": 1, "fine": 1}
    letters = {
        decode(letter.value, ResultEvent).request_id: (letter, hdr)
        for letter, hdr in await _read_dlq(settings, dlq, 3)
    }
    down, hdr = letters["always-down"]
    assert (down.error.code, down.attempts, down.offset) == ("retries_exhausted", 3, 0)
    assert "handler keeps failing" in down.error.message
    assert hdr["epd-error-attempts"] == b"3"
    assert letters["poison"][0].error.code == "expired"
    assert letters["poison"][0].attempts == 1
    inv, inv_hdr = letters["invalid"]
    assert (inv.error.rule, inv.error.modality, inv.error.item) == ("ec-params", "image", 1)
    assert inv_hdr["epd-error-rule"] == b"ec-params" and inv_hdr["epd-error-item"] == b"1"
    assert await _committed(settings, loop.config.group_id, TopicPartition(src, 0)) == 4


async def test_backpressure_bounds_in_flight(settings: Settings) -> None:
    src, dlq = await _topics(settings, partitions=2)
    n = 24
    await _produce(settings, src, [f"r{i}" for i in range(n)])
    running = 0
    peak = 0
    done: list[str] = []

    async def handler(ce: ConsumedEvent) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        done.append(ce.event.request_id)

    loop = ConsumeLoop(settings, _config(src, dlq, max_in_flight=3), handler)
    task = _run(loop)
    await _until(lambda: len(done) == n, "all records")
    await loop.stop()
    await task
    assert sorted(done) == sorted(f"r{i}" for i in range(n)), "nothing lost or duplicated"
    assert peak <= 3 and loop.max_seen_in_flight <= 3
    assert peak == 3, "the limit was reached, so backpressure was exercised"
    assert loop.pauses >= 1


async def test_restart_resumes_from_committed_offsets(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, [f"r{i}" for i in range(30)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    first: list[int] = []

    async def handler1(ce: ConsumedEvent) -> None:
        await asyncio.sleep(0.01 * (ce.offset % 3))  # finish out of order
        first.append(ce.offset)
        if len(first) == 10:
            loop1.request_stop()

    loop1 = ConsumeLoop(settings, _config(src, dlq, group_id=group, max_in_flight=4), handler1)
    await loop1.run_forever()
    tp = TopicPartition(src, 0)
    committed = await _committed(settings, group, tp)
    assert committed is not None and committed >= 10
    assert set(range(committed)) <= set(first), "committed past unfinished work"

    await _produce(settings, src, [f"r{i}" for i in range(30, 40)])
    second: list[int] = []

    async def handler2(ce: ConsumedEvent) -> None:
        second.append(ce.offset)

    loop2 = ConsumeLoop(settings, _config(src, dlq, group_id=group), handler2)
    task = _run(loop2)
    await _until(lambda: 39 in second, "the new records")
    await loop2.stop()
    await task
    assert min(second) == committed, "restart resumes exactly at the committed offset"
    assert set(first) | set(second) == set(range(40)), "no record lost"
    assert await _committed(settings, group, tp) == 40


async def test_stop_waits_for_in_flight_handler(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["slow"])
    started, release = asyncio.Event(), asyncio.Event()
    finished: list[int] = []

    async def handler(ce: ConsumedEvent) -> None:
        started.set()
        await release.wait()
        finished.append(ce.offset)

    loop = ConsumeLoop(settings, _config(src, dlq), handler)
    task = _run(loop)
    await asyncio.wait_for(started.wait(), 60)
    stopper = asyncio.create_task(loop.stop())
    await asyncio.sleep(0.3)
    assert not stopper.done(), "stop() returned while a handler was still running"
    release.set()
    await asyncio.wait_for(stopper, 60)
    await task
    assert finished == [0]
    assert await _committed(settings, loop.config.group_id, TopicPartition(src, 0)) == 1


async def test_shutdown_timeout_cancels_without_committing(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["quick", "stuck"])
    cancelled: list[int] = []
    done: list[int] = []

    async def handler(ce: ConsumedEvent) -> None:
        if ce.event.request_id == "stuck":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(ce.offset)
                raise
        done.append(ce.offset)

    loop = ConsumeLoop(settings, _config(src, dlq, shutdown_timeout_s=0.2), handler)
    task = _run(loop)
    await _until(lambda: done == [0] and loop.in_flight == 1, "quick done, stuck running")
    await loop.stop()
    await task
    assert cancelled == [1]
    assert await _committed(settings, loop.config.group_id, TopicPartition(src, 0)) == 1


async def test_retry_abandoned_on_stop_is_not_committed(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["down"])
    tried = asyncio.Event()

    async def handler(ce: ConsumedEvent) -> None:
        tried.set()
        raise TimeoutError("store wait timed out")

    cfg = _config(
        src,
        dlq,
        max_attempts=5,
        backoff_initial_s=30,
        backoff_max_s=30,
        transient_backoff_max_s=30,  # a TimeoutError is an outage: its pauses have their own cap
    )
    loop = ConsumeLoop(settings, cfg, handler)
    task = _run(loop)
    await asyncio.wait_for(tried.wait(), 60)
    await loop.stop()  # must not sit out the 30 s backoff
    await task
    assert loop.dead_lettered == 0
    assert await _committed(settings, loop.config.group_id, TopicPartition(src, 0)) is None


async def test_a_store_outage_longer_than_the_attempts_is_outlived(settings: Settings) -> None:
    """A store down for ~1.5 s: far more than max_attempts=2 tries at 10-50 ms apart, but well
    inside transient_retry_s, so the record completes and nothing goes to the DLQ. A handler
    error on the record after it still uses up its two attempts. Then the store goes down for
    good and the loop is stopped mid-outage: that record's offset stays uncommitted."""
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["outage", "bug", "down"])
    loop_time = asyncio.get_running_loop().time
    outage_until: list[float] = []  # set at the first try (the group join takes a while)
    tries: dict[str, int] = {}
    done: list[str] = []

    async def handler(ce: ConsumedEvent) -> None:
        rid = ce.event.request_id
        tries[rid] = tries.get(rid, 0) + 1
        if not outage_until:
            outage_until.append(loop_time() + 1.5)
        if rid == "outage" and loop_time() < outage_until[0]:
            raise StoreUnavailable("redis store: Connection refused")
        if rid == "bug":
            raise RuntimeError("a handler bug, not an outage")
        if rid == "down":
            raise StoreUnavailable("redis store: Connection refused")
        done.append(rid)

    cfg = _config(
        src,
        dlq,
        max_attempts=2,
        transient_retry_s=30,
        transient_backoff_max_s=0.05,
        max_in_flight=1,
    )
    loop = ConsumeLoop(settings, cfg, handler)
    task = _run(loop)
    await _until(lambda: done == ["outage"] and loop.dead_lettered == 1, "outage outlived")
    await _until(lambda: tries.get("down", 0) >= 3, "the next outage being retried")
    await loop.stop()
    await task
    assert tries["outage"] > cfg.max_attempts, tries
    assert tries["bug"] == cfg.max_attempts, tries
    [(letter, _)] = await _read_dlq(settings, dlq, 1)
    assert (letter.offset, letter.error.code, letter.attempts) == (1, "retries_exhausted", 2)
    # "outage" and "bug" are done; "down" was abandoned at stop: committed up to it, not past it.
    assert await _committed(settings, cfg.group_id, TopicPartition(src, 0)) == 2


async def test_rebalance_hands_over_partitions_without_loss(settings: Settings) -> None:
    src, dlq = await _topics(settings, partitions=2)
    await _produce(settings, src, [f"r{i}" for i in range(20)])
    group = f"g-{uuid.uuid4().hex[:8]}"
    seen: dict[str, list[str]] = {"a": [], "b": []}
    revoked: list[set[TopicPartition]] = []

    def make(name: str) -> ConsumeLoop:
        async def handler(ce: ConsumedEvent) -> None:
            await asyncio.sleep(0.02)
            seen[name].append(ce.event.request_id)

        return ConsumeLoop(settings, _config(src, dlq, group_id=group, max_in_flight=2), handler)

    a = make("a")
    real_revoked = a._on_revoked

    async def spy(tps: set[TopicPartition]) -> None:
        await real_revoked(tps)
        # once a partition is revoked nothing of it may still be running
        assert not a._in_flight.of(tps)
        revoked.append(tps)

    a._on_revoked = spy  # type: ignore[method-assign]
    task_a = _run(a)
    await _until(lambda: len(seen["a"]) >= 4, "a to make progress")
    b = make("b")
    task_b = _run(b)
    await _until(lambda: bool(b.assignment()), "b to get a partition")
    await _produce(settings, src, [f"r{i}" for i in range(20, 40)])
    everything = {f"r{i}" for i in range(40)}
    await _until(lambda: set(seen["a"]) | set(seen["b"]) >= everything, "all 40 records")
    await a.stop()
    await b.stop()
    await asyncio.gather(task_a, task_b)
    assert any(r for r in revoked), "a gave up a partition during the rebalance"
    assert seen["b"], "b processed records after the rebalance"
    for p in (0, 1):
        end = await _end_offset(settings, TopicPartition(src, p))
        assert await _committed(settings, group, TopicPartition(src, p)) == end


async def _end_offset(settings: Settings, tp: TopicPartition) -> int:
    c = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await c.start()
    try:
        return (await c.end_offsets([tp]))[tp]
    finally:
        await c.stop()


async def test_oversized_dead_letter_drops_the_payload(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    big = b"\x00not-avro" + b"x" * 8000
    await _produce(settings, src, [big, "after"])
    small = settings.model_copy(update={"max_message_bytes": 8192})
    seen: list[str] = []

    async def handler(ce: ConsumedEvent) -> None:
        seen.append(ce.event.request_id)

    loop = ConsumeLoop(small, _config(src, dlq), handler)
    task = _run(loop)
    await _until(lambda: seen == ["after"] and loop.dead_lettered == 1, "DLQ + next record")
    await loop.stop()
    await task
    [(letter, headers)] = await _read_dlq(settings, dlq, 1)
    assert (letter.offset, letter.value) == (0, b"")
    assert headers["epd-error-value-dropped"] == str(len(big)).encode()


async def test_a_record_over_the_message_cap_is_dead_lettered_unread(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["before", "after"])
    small = settings.model_copy(update={"max_message_bytes": 8192})
    producer = make_producer(settings, max_request_size=1 << 20)
    await producer.start()
    try:  # a valid event, just bigger than the consumer's cap: the broker hands it out anyway
        padded = ResultEvent("big", "test", "completed", text="x" * 20000)
        await KafkaPublisher(producer).send(src, "big", padded)
    finally:
        await producer.stop()
    await _produce(settings, src, ["last"])
    seen: list[str] = []

    async def handler(ce: ConsumedEvent) -> None:
        seen.append(ce.event.request_id)

    loop = ConsumeLoop(small, _config(src, dlq), handler)
    task = _run(loop)
    await _until(lambda: len(seen) == 3 and loop.dead_lettered == 1, "DLQ + the others")
    await loop.stop()
    await task
    assert seen == ["before", "after", "last"]
    [(letter, headers)] = await _read_dlq(settings, dlq, 1)
    assert (letter.offset, letter.error.code, letter.error.field) == (2, "oversize", "value")
    assert headers["epd-error-code"] == b"oversize"


async def test_metrics_registry_and_sigterm(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["one", "two"])
    registry = CollectorRegistry()
    seen: list[str] = []

    async def handler(ce: ConsumedEvent) -> None:
        if ce.attempt == 1 and ce.event.request_id == "one":
            raise ConnectionError("blip")
        seen.append(ce.event.request_id)

    cfg = _config(src, dlq)
    loop = ConsumeLoop(settings, cfg, handler, registry=registry)
    # a second loop on the same registry must not collide with the first one's series
    ConsumeLoop(settings, _config(src, dlq), handler, registry=registry)
    task = asyncio.create_task(loop.run_until_signal())
    await _until(lambda: len(seen) == 2, "both records")
    os.kill(os.getpid(), signal.SIGTERM)  # handled by the loop: a graceful stop
    await asyncio.wait_for(task, 60)
    labels = {"group": cfg.group_id}
    assert registry.get_sample_value("epd_consumer_processed_total", labels) == 2
    assert registry.get_sample_value("epd_consumer_retried_total", labels) == 1
    assert registry.get_sample_value("epd_consumer_in_flight", labels) == 0
    lag = {**labels, "topic": src, "partition": "0"}
    assert registry.get_sample_value("epd_consumer_lag", lag) == 0  # caught up
    assert await _committed(settings, cfg.group_id, TopicPartition(src, 0)) == 2


async def test_dead_letters_are_counted_by_code_and_rule(settings: Settings) -> None:
    from schemas.errors import ValidationError

    src, dlq = await _topics(settings)
    await _produce(settings, src, [b"\x00garbage", "bad"])
    registry = CollectorRegistry()

    async def handler(ce: ConsumedEvent) -> None:
        raise ValidationError("ec-transfer-required", "no entry", modality="image", item=0)

    cfg = _config(src, dlq)
    loop = ConsumeLoop(settings, cfg, handler, registry=registry)
    task = _run(loop)
    await _until(lambda: loop.dead_lettered == 2, "both dead-lettered")
    await loop.stop()
    await task
    group = cfg.group_id
    count = registry.get_sample_value
    assert count("epd_consumer_errors_total", {"group": group, "code": "undecodable", "rule": ""})
    assert (
        count(
            "epd_consumer_errors_total",
            {"group": group, "code": "validation", "rule": "ec-transfer-required"},
        )
        == 1
    )


class _Bug(BaseException):
    """Escapes the handler's error handling (it is not an Exception)."""


async def test_crash_outside_handler_fails_fast(settings: Settings) -> None:
    src, dlq = await _topics(settings)
    await _produce(settings, src, ["boom"])

    async def handler(ce: ConsumedEvent) -> None:
        raise _Bug("escaped")

    loop = ConsumeLoop(settings, _config(src, dlq), handler)
    with pytest.raises(RuntimeError, match="consume loop failed") as info:
        await asyncio.wait_for(loop.run_forever(), 60)
    assert isinstance(info.value.__cause__, _Bug)
    assert await _committed(settings, loop.config.group_id, TopicPartition(src, 0)) is None
