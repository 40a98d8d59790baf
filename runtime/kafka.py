"""aiokafka clients built from settings, topic creation, and framed-event produce helpers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from runtime.publisher import OutRecord, frame
from runtime.settings import Settings
from schemas.topics import Topics
from schemas.types import Event

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


FETCHER_TIMEOUT_MS = 5000
"""How often aiokafka's background fetch routine wakes with nothing to do (its default: every
200 ms). It is a safety net: a fetch answer, a consumed batch, a seek, a pause or resume, an
assignment or a metadata update wake it anyway, so an idle consumer needs no timer of its own."""


def make_consumer(
    settings: Settings, *topics: str, group_id: str | None, **overrides: object
) -> AIOKafkaConsumer:
    """A consumer with manual commits that starts from the earliest offset of a new group."""
    kwargs: dict[str, object] = {
        "consumer_timeout_ms": FETCHER_TIMEOUT_MS,
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


def set_fetch(consumer: AIOKafkaConsumer, *, wait_ms: int, min_bytes: int) -> bool:
    """Change how the broker holds ``consumer``'s next fetches (``fetch_max_wait_ms``,
    ``fetch_min_bytes``) while it runs; False when it cannot be done (not started, or an aiokafka
    that keeps them elsewhere: the consumer then keeps the fetch it was made with).

    aiokafka has no public setter; its fetcher reads both attributes for each fetch it builds
    (aiokafka 0.14; ``tests/unit/test_idle_consumers.py`` checks that they are still there).
    """
    fetcher = getattr(consumer, "_fetcher", None)
    if fetcher is None or not hasattr(fetcher, "_fetch_max_wait_ms"):
        return False
    if not hasattr(fetcher, "_fetch_min_bytes"):
        return False
    fetcher._fetch_max_wait_ms = wait_ms
    fetcher._fetch_min_bytes = min_bytes
    return True


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


class KafkaPublisher:
    """The Publisher of real runs: aiokafka producers, one per compression setting and one
    for the records off the client's path.

    Prefill events are mostly runs of placeholder token ids and travel with
    ``settings.prefill_compression``; encoder inputs (pixels barely compress) and everything else
    with ``settings.compression``; status updates and encoded marks (``results``, ``encoded``)
    through a producer that lingers ``settings.results_linger_ms``, so under load the updates
    of concurrent requests share a produce request. ``routes`` maps a topic to the producer
    that sends it.
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
        if settings.results_linger_ms > 0:
            # Status updates and encoded marks are written through to the record first, so
            # their records are off the client's path: they may wait a little for company.
            batched = make_producer(settings, linger_ms=settings.results_linger_ms)
            routes[topics.results] = routes[topics.encoded] = batched
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
        value: bytes | None = None,
    ) -> int:
        record = frame(event, key, headers=headers, value=value)
        await self.routes.get(topic, self.producer).send_and_wait(
            topic, value=record.value, key=record.key, headers=record.headers
        )
        return len(record.value)

    async def send_all(self, topic: str, records: Sequence[OutRecord]) -> None:
        """Queue every record in order (the producer keeps a partition's records in the order
        they were queued), then wait for the acknowledgements together."""
        producer = self.routes.get(topic, self.producer)
        acks: list[asyncio.Future[Any]] = []
        try:
            for key, event, headers in records:
                record = frame(event, key, headers=headers)
                acks.append(
                    await producer.send(
                        topic, value=record.value, key=record.key, headers=record.headers
                    )
                )
        finally:
            # Every queued record's outcome is awaited, even when a later one failed to queue.
            done = await asyncio.gather(*acks, return_exceptions=True)
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome


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
