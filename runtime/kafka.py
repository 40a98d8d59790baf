"""aiokafka clients built from settings, topic creation, and framed-event produce helpers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from runtime.publisher import Publisher, event_headers
from runtime.settings import Settings
from runtime.tracing import current_carrier, current_trace_id
from schemas.codec import get_codec
from schemas.topics import Topics
from schemas.types import ErrorInfo, Event, ResultEvent

log = logging.getLogger(__name__)


def make_producer(
    settings: Settings, *, compression: str | None = None, **overrides: object
) -> AIOKafkaProducer:
    """A producer with acks=all and the configured message cap; idempotence is a setting.

    ``compression`` overrides ``settings.compression`` (e.g. ``settings.prefill_compression``
    for the fan-out's prefill producer).
    """
    kwargs: dict[str, object] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "acks": "all",
        "enable_idempotence": settings.kafka_idempotence,
        "max_request_size": settings.max_message_bytes,
        "linger_ms": 0,
    }
    codec = compression or settings.compression
    if codec != "none":
        kwargs["compression_type"] = codec
    kwargs.update(overrides)
    return AIOKafkaProducer(**kwargs)  # type: ignore[arg-type]


class TransactionsUnsupported(RuntimeError):
    """EPD_KAFKA_TRANSACTIONS is on but the broker refused a transactional producer."""


def transactional_id(settings: Settings, group_id: str) -> str:
    """The transactional id of one consume loop: ``{base}:{group}``.

    ``base`` is ``EPD_KAFKA_TRANSACTIONAL_ID`` (stable per worker instance: a restarted worker
    with the same id fences its predecessor and aborts its open transaction at once) or, unset,
    ``{host}:{pid}`` (unique, but a crashed worker's open transaction is only aborted by the
    broker after ``EPD_KAFKA_TRANSACTION_TIMEOUT_MS``).
    """
    base = settings.kafka_transactional_id or f"{socket.gethostname()}:{os.getpid()}"
    return f"{base}:{group_id}"


def make_transactional_producer(settings: Settings, txn_id: str) -> AIOKafkaProducer:
    """An idempotent producer with ``transactional_id``; its sends must be inside transactions."""
    return make_producer(
        settings,
        transactional_id=txn_id,
        transaction_timeout_ms=settings.kafka_transaction_timeout_ms,
        enable_idempotence=True,
    )


def is_transactional(producer: AIOKafkaProducer) -> bool:
    """Whether ``producer`` was built with a ``transactional_id``.

    aiokafka keeps it on its transaction manager and has no public accessor."""
    manager = getattr(producer, "_txn_manager", None)
    return bool(manager is not None and getattr(manager, "transactional_id", None))


async def start_producer(producer: AIOKafkaProducer, settings: Settings) -> None:
    """``producer.start()``; a transactional one the broker refuses raises a clear error.

    A broker without transactions (Tansu) answers InitProducerId with an error, so this is
    where ``EPD_KAFKA_TRANSACTIONS=true`` against such a broker is detected.
    """
    try:
        await producer.start()
    except KafkaError as exc:
        if not is_transactional(producer):
            raise
        with contextlib.suppress(Exception):
            await producer.stop()
        raise TransactionsUnsupported(
            f"EPD_KAFKA_TRANSACTIONS=true, but the broker at {settings.kafka_bootstrap} refused "
            f"a transactional producer ({exc!r}); transactions need Apache Kafka (the embedded "
            "Tansu has none): EPD_BROKER=apache, or unset EPD_KAFKA_TRANSACTIONS"
        ) from exc


def make_consumer(
    settings: Settings, *topics: str, group_id: str | None, **overrides: object
) -> AIOKafkaConsumer:
    """A consumer with manual commits that starts from the earliest offset of a new group."""
    kwargs: dict[str, object] = {
        "bootstrap_servers": settings.kafka_bootstrap,
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "fetch_max_bytes": max(settings.max_message_bytes * 2, 52428800),
        "max_partition_fetch_bytes": settings.max_message_bytes,
        "session_timeout_ms": settings.kafka_session_timeout_ms,
        "heartbeat_interval_ms": settings.kafka_heartbeat_interval_ms,
        "fetch_max_wait_ms": settings.kafka_fetch_max_wait_ms,
    }
    if settings.kafka_transactions:
        # Outputs of aborted or still-open transactions are never handed out.
        kwargs["isolation_level"] = "read_committed"
    kwargs.update(overrides)
    return AIOKafkaConsumer(*topics, **kwargs)  # type: ignore[arg-type]


async def ensure_topics(
    settings: Settings,
    topics: Iterable[str],
    *,
    partitions: int | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create missing topics with the configured partitions and ``max.message.bytes``.

    Returns the names that were created. Existing topics are left as they are.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await asyncio.wait_for(admin.start(), timeout_s)
    created: list[str] = []
    try:
        existing = set(await admin.list_topics())
        new = [
            NewTopic(
                name=t,
                num_partitions=partitions or settings.topic_partitions,
                replication_factor=1,
                topic_configs={"max.message.bytes": str(settings.max_message_bytes)},
            )
            for t in topics
            if t not in existing
        ]
        if new:
            try:
                await admin.create_topics(new, timeout_ms=int(timeout_s * 1000))
            except TopicAlreadyExistsError:
                pass  # raced with another process creating the same topic
            created = [t.name for t in new]
    finally:
        await admin.close()
    return created


async def send_event(producer: AIOKafkaProducer, topic: str, key: str | None, event: Event) -> None:
    """Encode and send one event, waiting for the broker's acknowledgement."""
    await KafkaPublisher(producer).send(topic, key, event)


class KafkaPublisher:
    """The Publisher of real runs: aiokafka producers, one per compression setting.

    Prefill events are mostly runs of placeholder token ids and travel with
    ``settings.prefill_compression``; encoder inputs (pixels barely compress) and everything else
    with ``settings.compression``. ``routes`` maps a topic to the producer that sends it.
    """

    def __init__(
        self,
        producer: AIOKafkaProducer,
        routes: dict[str, AIOKafkaProducer] | None = None,
        *,
        settings: Settings | None = None,
    ) -> None:
        self.producer = producer
        self.routes = dict(routes or {})
        self.settings = settings

    @classmethod
    def for_pipeline(
        cls, settings: Settings, topics: Topics, *, txn_id: str | None = None
    ) -> KafkaPublisher:
        """Producers for one pipeline (not started: ``await start()``).

        With ``txn_id`` there is one transactional producer for every topic (a transaction
        belongs to one producer, so prefill events lose their own compression there) and
        every send must happen inside a transaction the consume loop opened.
        """
        if txn_id is not None:
            settings.require_transactions_possible()
            return cls(make_transactional_producer(settings, txn_id), settings=settings)
        producer = make_producer(settings)
        routes = {}
        if settings.prefill_compression != settings.compression:
            routes[topics.prefill] = make_producer(
                settings, compression=settings.prefill_compression
            )
        return cls(producer, routes, settings=settings)

    def _producers(self) -> list[AIOKafkaProducer]:
        return [self.producer, *{id(p): p for p in self.routes.values()}.values()]

    async def start(self) -> None:
        """Connect every producer (a refused transactional one raises TransactionsUnsupported)."""
        for p in self._producers():
            if self.settings is not None:
                await start_producer(p, self.settings)
            else:
                await p.start()

    async def stop(self) -> None:
        """Flush and close every producer."""
        for p in self._producers():
            await p.stop()

    async def send(
        self,
        topic: str,
        key: str | None,
        event: Event,
        *,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> int:
        value = get_codec().encode(event)
        # The active trace context travels as a W3C header beside the event's own trace map.
        trace_headers = [(k, v.encode()) for k, v in current_carrier().items()]
        await self.routes.get(topic, self.producer).send_and_wait(
            topic,
            value=value,
            key=key.encode() if key is not None else None,
            headers=[*event_headers(event), *trace_headers, *headers],
        )
        return len(value)


async def topic_partitions(settings: Settings, topics: Sequence[str]) -> dict[str, list[int]]:
    """The partition ids of each of ``topics`` that exists (the admin client's metadata: a new
    consumer knows no topic's partitions until it subscribes or is assigned)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(list(topics))
    finally:
        await admin.close()
    return {
        d["topic"]: sorted(p["partition"] for p in d["partitions"])
        for d in described
        if not d.get("error_code") and d.get("partitions")
    }


async def read_topic(settings: Settings, topic: str, *, timeout_s: float = 30.0) -> list[Any]:
    """Every record of ``topic`` from the beginning up to its current end (no consumer group).

    Returns aiokafka ConsumerRecords; decode their values with the codec. For tools and tests
    that inspect what was sent (the demo's byte counts, the e2e test's DLQ check).
    """
    consumer = make_consumer(settings, group_id=None)
    try:
        await consumer.start()
        partitions = (await topic_partitions(settings, [topic])).get(topic, [])
        tps = [TopicPartition(topic, p) for p in partitions]
        if not tps:
            return []
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        records: list[Any] = []
        remaining = {tp for tp in tps if end[tp] > 0}
        deadline = asyncio.get_running_loop().time() + timeout_s
        while remaining:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"reading {topic} did not reach the end offsets in {timeout_s}s")
            batch = await consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)
            # The position, not the last record's offset: transaction markers take offsets too,
            # so a read_committed reader's last record sits below the end it is told about.
            for tp in list(remaining):
                if await consumer.position(tp) >= end[tp]:
                    remaining.discard(tp)
        return records
    finally:
        await consumer.stop()


StatusWriter = Callable[[ResultEvent], Awaitable[object]]
"""Folds one update into the request's status record (``StatusStore.apply``)."""


class ResultReporter:
    """Sends one stage's ResultEvents (status updates and outcomes) to the results topic.

    Each record carries a stable id in the :attr:`RESULT_ID_HEADER` Kafka header,
    ``{request_id}:{stage}:{status}``, so a downstream reader can drop duplicates (the results
    topic is at-least-once: a worker that crashes before committing sends its updates again).
    It is the same pair the status record dedupes by: one id per stage outcome of a request,
    however many times that outcome is sent.

    ``record`` (write-through, e.g. ``StatusStore.apply``): each update is also folded into the
    request's status record directly, beside the send, so a client polling the record sees it
    without waiting for the results collector's hop. The topic stays the durable record: the
    collector folds the same update later as a duplicate, and a failed direct write (Redis
    away) is only logged.
    """

    RESULT_ID_HEADER = "epd-result-id"
    WRITE_THROUGH_TIMEOUT_S = 2.0

    @staticmethod
    def result_id(request_id: str, stage: str, status: str) -> str:
        """The stable id of one (request, stage, status) update."""
        return f"{request_id}:{stage}:{status}"

    def __init__(
        self,
        publisher: Publisher,
        results_topic: str,
        stage: str,
        worker: str = "",
        *,
        record: StatusWriter | None = None,
    ):
        self.publisher = publisher
        self.topic = results_topic
        self.stage = stage
        self.worker = worker
        self.record = record

    async def __call__(
        self,
        request_id: str,
        status: str,
        *,
        token_ids: list[int] | None = None,
        text: str | None = None,
        error: ErrorInfo | None = None,
        timings: dict[str, float] | None = None,
        info: dict[str, str] | None = None,
    ) -> None:
        """Publish one update for ``request_id`` (keyed by it, so a request stays ordered)."""
        event = self.update(
            request_id,
            status,
            token_ids=token_ids,
            text=text,
            error=error,
            timings=timings,
            info=info,
        )
        if self.record is None:
            await self.send(event)
            return
        # Both must be done before the caller goes on: the caller's next update (or the event
        # it publishes next) must not overtake this one in the record. The record first: it is
        # what a waiting client sees.
        await asyncio.gather(self.write_through(event), self.send(event))

    def update(
        self,
        request_id: str,
        status: str,
        *,
        token_ids: list[int] | None = None,
        text: str | None = None,
        error: ErrorInfo | None = None,
        timings: dict[str, float] | None = None,
        info: dict[str, str] | None = None,
    ) -> ResultEvent:
        """The ResultEvent of one update of this stage (with the active trace's id in ``info``),
        for callers that send it and write it through separately (:meth:`send`,
        :meth:`write_through`)."""
        info = dict(info or {})
        trace_id = current_trace_id()
        if trace_id is not None:
            info.setdefault("trace_id", trace_id)  # the request's trace, on its status record
        return ResultEvent(
            request_id=request_id,
            stage=self.stage,
            status=status,
            token_ids=token_ids,
            text=text,
            error=error,
            timings=timings or {},
            info=info,
            worker=self.worker,
        )

    async def send(self, event: ResultEvent) -> None:
        """Publish ``event`` to the results topic, keyed by its request, with its result id."""
        rid = self.result_id(event.request_id, self.stage, event.status)
        await self.publisher.send(
            self.topic, event.request_id, event, headers=[(self.RESULT_ID_HEADER, rid.encode())]
        )

    async def write_through(self, event: ResultEvent) -> None:
        """Fold ``event`` into the status record now (nothing without a ``record`` writer); a
        failure is only logged: the results topic still carries the update."""
        if self.record is None:
            return
        try:
            # Bounded: a frozen Redis must not hold the stage up; the topic carries the update.
            await asyncio.wait_for(self.record(event), self.WRITE_THROUGH_TIMEOUT_S)
        except Exception as exc:  # any failure: the results topic still carries the update
            log.warning(
                "status write-through of %s %s failed (%r); the results topic carries it",
                event.request_id,
                event.status,
                exc,
            )


class RequestUpdates:
    """One request's updates from one stage, kept in order, without holding the stage up.

    :meth:`soon` starts a progress update (``prefilling``, ``decoding``) in the background:
    the stage goes on with its work while the broker acknowledges it and the record takes it.
    Each update waits for the one before it, so the record and the results topic see them in
    the order they were made; :meth:`now` (an outcome) waits for every earlier one first.
    A background update that failed raises from the next :meth:`now` or :meth:`flush`, so the
    consume loop retries the event exactly as if the update had failed in place.
    """

    def __init__(self, reporter: ResultReporter, request_id: str) -> None:
        self.reporter = reporter
        self.request_id = request_id
        self._last: asyncio.Task[None] | None = None

    def soon(self, status: str, **fields: Any) -> None:
        """Start one update after the earlier ones; return at once."""
        before = self._last

        async def send_after() -> None:
            if before is not None:
                await before
            await self.reporter(self.request_id, status, **fields)

        self._last = asyncio.create_task(send_after())

    async def now(self, status: str, **fields: Any) -> None:
        """One update, sent and recorded before this returns (earlier ones first)."""
        await self.flush()
        await self.reporter(self.request_id, status, **fields)

    async def flush(self) -> None:
        """Wait for every update started so far; raise the first failure among them."""
        last, self._last = self._last, None
        if last is not None:
            await last

    async def abandon(self) -> None:
        """The stage failed or is being cancelled: end the updates still in flight quietly
        (a retry of the event sends them again; the record folds repeats away)."""
        last, self._last = self._last, None
        if last is None or last.done():
            if last is not None and not last.cancelled():
                last.exception()  # retrieved: the stage's own failure is the one that matters
            return
        last.cancel()
        with contextlib.suppress(BaseException):
            await last
