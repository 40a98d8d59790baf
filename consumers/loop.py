"""The consume loop every worker runs: at-least-once, ordered commits, retries, DLQ, backpressure.

A worker supplies an async handler for one decoded event; :class:`ConsumeLoop` does the rest:

* **At-least-once.** Auto-commit is off. An offset is committed only after its handler returned
  (or its dead letter was acknowledged by the broker), and commits follow offset order per
  partition even when handlers finish out of order (:class:`~consumers.commits.CommitTracker`).
  Handlers must therefore be idempotent: a crash re-delivers whatever was not committed.
* **Concurrency and backpressure.** Each record runs as its own task; at most ``max_in_flight``
  run at once. At the limit the loop pauses every assigned partition (it keeps polling, so the
  group membership stays alive) and resumes when a slot frees. Records a poll returns beyond the
  free slots are given back with ``seek``, never dropped.
* **Retries.** A transient failure (see :func:`~consumers.retry.default_is_transient`) is retried
  with jittered exponential backoff (:class:`~consumers.retry.RetryPolicy`): a store or broker
  outage (:func:`~consumers.retry.default_is_infrastructure`) for ``transient_retry_s`` seconds
  from its first occurrence (never past the event's ``deadline_ms``), so a Redis restart of a few
  seconds sends nothing valid to the DLQ; any other error up to ``max_attempts`` tries.
* **Dead letters.** A record over ``max_message_bytes`` (code ``oversize``, never decoded),
  undecodable bytes, a permanent error (``Poison``, ``ValidationError``,
  ``CodecError``) or a transient one that exhausted its attempts is published to the DLQ topic as
  a ``DeadLetter`` carrying the original topic/partition/offset/key/value/headers plus the error,
  with ``epd-error-*`` Kafka headers; then its offset counts as done and the loop moves on.
  ``on_dead_letter`` lets the worker also report it (e.g. a ``rejected`` ResultEvent).
* **Rebalance.** When partitions are revoked, their in-flight handlers get ``revoke_timeout_s``
  to finish; the rest are cancelled, and what is done is committed before the partitions go.
* **Transactions** (``EPD_KAFKA_TRANSACTIONS=true``, Apache Kafka only): the loop works in
  batches, each one Kafka transaction holding the handlers' outputs (sent through the loop's
  transactional producer, which must be the one their publisher uses), the dead letters and the
  offsets; a batch with an unfinished record is aborted and fetched again. See
  :mod:`consumers.transactions` for the barrier and its trade-off.
* **Shutdown.** :meth:`ConsumeLoop.stop` (or SIGTERM/SIGINT under
  :meth:`ConsumeLoop.run_until_signal`) stops fetching, abandons pending retries, lets running
  handlers finish within ``shutdown_timeout_s``, cancels the rest, commits, and closes. A cancelled
  or abandoned handler's offset is never committed, so its record is delivered again later.

Never pickles: events are decoded with the Avro codec (or the ``decode`` callable given).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, MessageSizeTooLargeError
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from consumers.commits import CommitTracker
from consumers.retry import (
    Poison,
    RetryPolicy,
    Transient,
    backoff_delay,
    default_is_infrastructure,
    default_is_transient,
    error_info,
)
from consumers.transactions import BatchSpan, ProducerFenced, abort_quietly, commit_batch
from runtime.kafka import (
    is_transactional,
    make_consumer,
    make_producer,
    make_transactional_producer,
    start_producer,
    transactional_id,
)
from runtime.metrics import per_registry
from runtime.publisher import frame
from runtime.settings import Settings
from runtime.tracing import carrier_of, stage_span
from schemas import codec
from schemas import dead_letters as envelope
from schemas.types import DeadLetter, ErrorInfo, now_ms

log = logging.getLogger(__name__)

__all__ = [
    "ConsumeLoop",
    "ConsumedEvent",
    "ConsumerConfig",
    "DeadLetterHook",
    "Handler",
    "Poison",
    "Transient",
]


@dataclass(slots=True)
class ConsumedEvent:
    """One record as a handler sees it. ``event`` is None only for undecodable records (DLQ)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    value: bytes
    event: Any
    timestamp_ms: int = -1
    attempt: int = 1
    """1 on the first try, 2 on the first retry, ..."""

    @property
    def key_str(self) -> str | None:
        """The key decoded as UTF-8 (request ids and mm hashes are text)."""
        return self.key.decode("utf-8", "replace") if self.key is not None else None


Handler = Callable[[ConsumedEvent], Awaitable[None]]
DeadLetterHook = Callable[[ConsumedEvent, ErrorInfo], Awaitable[None]]


@dataclass(slots=True)
class ConsumerConfig:
    """What one consume loop reads and how hard it tries."""

    topics: list[str]
    group_id: str
    dlq_topic: str
    max_in_flight: int = 64
    max_attempts: int = 3
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    transient_retry_s: float = 30.0
    """Time budget for store/broker outages (retried however many tries it takes)."""
    transient_backoff_max_s: float = 2.0
    """Longest pause between tries during an outage: work resumes this soon after it ends."""
    commit_interval_s: float = 0.5
    commit_timeout_s: float = 10.0
    """Bound on one commit (and on closing the clients): a dead coordinator must not hang us."""
    shutdown_timeout_s: float = 30.0
    revoke_timeout_s: float = 10.0
    poll_timeout_ms: int = 200
    consumer_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra ``AIOKafkaConsumer`` arguments (session timeouts, client id, ...)."""

    def __post_init__(self) -> None:
        if not self.topics:
            raise ValueError("ConsumerConfig.topics must name at least one topic")
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.transient_retry_s < 0:
            raise ValueError(f"transient_retry_s must be >= 0, got {self.transient_retry_s}")

    def retry_policy(self) -> RetryPolicy:
        """The retry budget these settings describe."""
        return RetryPolicy(
            max_attempts=self.max_attempts,
            backoff_initial_s=self.backoff_initial_s,
            backoff_max_s=self.backoff_max_s,
            transient_retry_s=self.transient_retry_s,
            transient_backoff_max_s=self.transient_backoff_max_s,
        )


class _Metrics:
    """Prometheus series for consume loops, labelled by consumer group."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        labels = ["group"]
        self.processed = Counter(
            "epd_consumer_processed", "Records handled successfully", labels, registry=registry
        )
        self.retried = Counter(
            "epd_consumer_retried",
            "Handler retries after transient failures",
            labels,
            registry=registry,
        )
        self.dead_lettered = Counter(
            "epd_consumer_dead_lettered", "Records sent to the DLQ", labels, registry=registry
        )
        self.in_flight = Gauge(
            "epd_consumer_in_flight", "Handlers running now", labels, registry=registry
        )
        self.paused = Counter(
            "epd_consumer_backpressure_pauses",
            "Times the loop paused fetching at max_in_flight",
            labels,
            registry=registry,
        )
        self.handler_seconds = Histogram(
            "epd_consumer_handler_seconds",
            "Handler wall time per attempt",
            labels,
            registry=registry,
        )
        self.errors = Counter(
            "epd_consumer_errors",
            "Dead-lettered records by error code and validation rule",
            ["group", "code", "rule"],
            registry=registry,
        )
        self.lag = Gauge(
            "epd_consumer_lag",
            "Records behind the partition's end (high watermark - position)",
            ["group", "topic", "partition"],
            registry=registry,
        )


@dataclass(slots=True)
class _Failures:
    """One record's failures so far, as the retry policy weighs them: handler errors, and
    infrastructure outages timed from the first one."""

    handler: int = 0
    infrastructure: int = 0
    outage_began: float | None = None

    def count(self, *, permanent: bool, infrastructure: bool) -> None:
        if infrastructure:
            self.infrastructure += 1
            if self.outage_began is None:
                self.outage_began = time.monotonic()
        elif not permanent:
            self.handler += 1

    def outage_s(self) -> float:
        """How long the outage has lasted (0 when there was none)."""
        return time.monotonic() - self.outage_began if self.outage_began is not None else 0.0


def _deadline_left_s(event: Any) -> float | None:
    """Seconds until ``event``'s ``deadline_ms`` (negative once past; None if it has none)."""
    deadline = getattr(event, "deadline_ms", None)
    return (deadline - now_ms()) / 1000 if isinstance(deadline, int) else None


def _metrics_for(registry: CollectorRegistry | None) -> _Metrics:
    # One set per registry: several loops (encode + prefill in one process) share series.
    return per_registry(_Metrics, registry)


class _Abandoned(Exception):
    """A retry was dropped because the loop is stopping: leave the offset uncommitted."""


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: ConsumeLoop) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: Sequence[TopicPartition]) -> None:
        await self._owner._on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: Sequence[TopicPartition]) -> None:
        log.info("%s: assigned %s", self._owner.config.group_id, sorted(assigned))
        self._owner._on_assigned(set(assigned))
        if assigned:
            self._owner.assigned.set()


class ConsumeLoop:
    """Runs ``handler`` over the records of ``config.topics``; see the module docstring.

    Usage::

        async with ConsumeLoop(settings, config, handler) as loop:
            await loop.run_until_signal()   # or run_forever(), ended by stop()
    """

    def __init__(
        self,
        settings: Settings,
        config: ConsumerConfig,
        handler: Handler,
        *,
        decode: Callable[[bytes], Any] = codec.decode,
        producer: AIOKafkaProducer | None = None,
        is_transient: Callable[[BaseException], bool] = default_is_transient,
        is_infrastructure: Callable[[BaseException], bool] = default_is_infrastructure,
        on_dead_letter: DeadLetterHook | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        self._handler = handler
        self._decode = decode
        self._producer = producer
        self._own_producer = producer is None
        self.transactional = settings.kafka_transactions
        settings.require_transactions_possible()
        if self.transactional and producer is not None and not is_transactional(producer):
            raise ValueError(
                "EPD_KAFKA_TRANSACTIONS=true: the loop's producer must be transactional (the "
                "one the handlers' publisher sends with, from KafkaPublisher.for_pipeline(..., "
                "txn_id=...)), else their outputs would escape the transaction"
            )
        self._batch_idle = asyncio.Event()
        self._batch_idle.set()
        self.transactions_committed = 0
        self.transactions_aborted = 0
        self._is_transient = is_transient
        self._is_infrastructure = is_infrastructure
        self._policy = config.retry_policy()
        self._on_dead_letter = on_dead_letter
        self._metrics = _metrics_for(registry)
        self._consumer: AIOKafkaConsumer | None = None
        self._tracker: CommitTracker[TopicPartition] = CommitTracker()
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._stop_event = asyncio.Event()
        self._capacity = asyncio.Event()
        self._paused_by_us: set[TopicPartition] = set()
        self._next_offset: dict[TopicPartition, int] = {}
        self.log_rewinds = 0
        """Partitions found to have lost records and read again from the start."""
        self._lost_topics: set[str] = set()
        """Topics whose log the broker lost, until their start offsets are committed: the group's
        committed offsets may point into the log that is gone (a commit sent before the loss was
        seen lands on the new log), so the partitions of them assigned meanwhile are re-read."""
        self._to_rewind: set[TopicPartition] = set()
        self._commit_lock = asyncio.Lock()
        """Commits go one at a time: a lost log's start is committed after any sent before."""
        self._last_commit = 0.0
        self._started = False
        self._running = False
        self._closed = False
        self._finished = asyncio.Event()
        self.assigned = asyncio.Event()
        """Set once this member first holds partitions (readiness for supervisors and tests)."""
        # plain counters, for tests and status pages
        self.processed = 0
        self.retried = 0
        self.dead_lettered = 0
        self.max_seen_in_flight = 0
        self.pauses = 0
        self.failure: BaseException | None = None
        """Set when a record task crashed outside the handler; run_forever then raises it."""

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Handlers running (or waiting to retry) right now."""
        return len(self._tasks)

    def assignment(self) -> set[TopicPartition]:
        """Partitions this member holds now (empty before start)."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("ConsumeLoop.start() has not run")
        return self._consumer

    async def start(self) -> None:
        """Connect the producer (for the DLQ) and join the consumer group."""
        if self._started:
            return
        if self._producer is None:
            self._producer = (
                make_transactional_producer(
                    self.settings, transactional_id(self.settings, self.config.group_id)
                )
                if self.transactional
                else make_producer(self.settings)
            )
        if self._own_producer:
            await start_producer(self._producer, self.settings)
        consumer = make_consumer(
            self.settings, group_id=self.config.group_id, **self.config.consumer_overrides
        )
        consumer.subscribe(self.config.topics, listener=_Rebalance(self))
        try:
            await consumer.start()
        except BaseException:
            if self._own_producer:
                await self._producer.stop()
            raise
        self._consumer = consumer
        self._started = True

    async def __aenter__(self) -> ConsumeLoop:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def request_stop(self) -> None:
        """Ask the loop to stop (safe from signal handlers); :meth:`stop` also waits for it."""
        self._stop_event.set()

    async def stop(self) -> None:
        """Stop fetching, drain in-flight work (within ``shutdown_timeout_s``), commit, close."""
        self._stop_event.set()
        if self._running:
            await self._finished.wait()
        else:
            await self._shutdown()

    async def run_forever(self) -> None:
        """Fetch and dispatch until :meth:`stop`; shuts down cleanly on the way out."""
        await self.start()
        self._running = True
        stop_wait = asyncio.create_task(self._stop_event.wait())
        try:
            while not self._stop_event.is_set():
                if self.transactional:
                    await self._transaction_batch(stop_wait)
                    continue
                await self._poll_once(stop_wait)
                await self._maybe_commit()
        finally:
            stop_wait.cancel()
            try:
                await self._shutdown()
            finally:
                self._running = False
                self._finished.set()
        if self.failure is not None:
            raise RuntimeError(f"{self.config.group_id}: consume loop failed") from self.failure

    async def run_until_signal(
        self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        """:meth:`run_forever` with SIGTERM/SIGINT mapped to a graceful stop."""
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.add_signal_handler(sig, self.request_stop)
        try:
            await self.run_forever()
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)

    # --- fetching ----------------------------------------------------------------------------

    async def _poll_once(self, stop_wait: asyncio.Task[bool]) -> None:
        consumer = self.consumer
        free = self.config.max_in_flight - len(self._tasks)
        assigned = consumer.assignment()
        waits: list[asyncio.Future[Any]] = [stop_wait]
        if free <= 0:
            # Full: pause everything assigned (new assignments too) but keep polling, so the
            # member stays in the group; wake as soon as a slot frees.
            to_pause = assigned - consumer.paused()
            if to_pause:
                if not self._paused_by_us:  # a new pause episode, not a top-up after a rebalance
                    self.pauses += 1
                    self._metrics.paused.labels(self.config.group_id).inc()
                consumer.pause(*to_pause)
                self._paused_by_us |= to_pause
            self._capacity.clear()
            waits.append(asyncio.ensure_future(self._capacity.wait()))
        elif self._paused_by_us:
            still = self._paused_by_us & assigned
            if still:
                consumer.resume(*still)
            self._paused_by_us.clear()
        batch = await self._fetch(stop_wait, max(1, free), waits[1:])
        if batch is not None:
            self._dispatch(batch)
            self._record_lag()
        await self._rewind_lost_logs()

    async def _fetch(
        self,
        stop_wait: asyncio.Task[bool],
        max_records: int,
        extra_waits: Sequence[asyncio.Future[Any]] = (),
    ) -> dict[TopicPartition, list[Any]] | None:
        """One ``getmany``, given up when the loop stops (or an extra wait ends) first."""
        consumer = self.consumer
        waits: list[asyncio.Future[Any]] = [stop_wait, *extra_waits]
        fetch = asyncio.ensure_future(
            consumer.getmany(timeout_ms=self.config.poll_timeout_ms, max_records=max_records)
        )
        try:
            await asyncio.wait([fetch, *waits], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits[1:]:
                w.cancel()
            if not fetch.done():
                fetch.cancel()
                await asyncio.wait([fetch])
        if fetch.cancelled():
            return None
        exc = fetch.exception()
        if exc is not None:
            if isinstance(exc, KafkaError):
                log.warning("%s: fetch failed: %r", self.config.group_id, exc)
                await asyncio.sleep(self.config.backoff_initial_s)
                return None
            raise exc
        result: dict[TopicPartition, list[Any]] = fetch.result()
        return result

    # --- transactional batches -----------------------------------------------------------------

    async def _transaction_batch(self, stop_wait: asyncio.Task[bool]) -> None:
        """Fetch a batch, run it inside one transaction, commit it with its offsets or abort it."""
        batch = await self._fetch(stop_wait, self.config.max_in_flight)
        if not batch or self._stop_event.is_set():
            if batch:  # fetched as the stop came: hand the records back undispatched
                for tp, records in batch.items():
                    if records and tp in self.consumer.assignment():
                        self.consumer.seek(tp, records[0].offset)
            return
        producer = self._producer
        assert producer is not None
        group = self.config.group_id
        span = BatchSpan()
        self._batch_idle.clear()
        began = False  # whether there is an open transaction to abort
        try:
            await producer.begin_transaction()
            began = True
            self._dispatch(batch, span)
            self._record_lag()
            await self._await_batch(list(self._tasks), stop_wait)
            offsets = self._tracker.to_commit(span.last)
            if not span or not span.complete(offsets):
                raise _Abandoned
            await commit_batch(producer, offsets, group)
            self._tracker.mark_committed(offsets)
            self.transactions_committed += 1
        except ProducerFenced as exc:
            # Another incarnation with our transactional id took over: this one is a zombie.
            log.error("%s: producer fenced; stopping", group)
            self.failure = self.failure or exc
            self._stop_event.set()
            self._rewind(span)
        except (_Abandoned, KafkaError, TimeoutError) as exc:
            if not isinstance(exc, _Abandoned):
                log.warning(
                    "%s: transaction failed (%r); the batch will be re-delivered", group, exc
                )
            try:
                if began:
                    await abort_quietly(producer, group)
            except ProducerFenced as fenced:
                self.failure = self.failure or fenced
                self._stop_event.set()
            self._rewind(span)
        finally:
            self._batch_idle.set()

    async def _await_batch(
        self, tasks: list[asyncio.Task[None]], stop_wait: asyncio.Task[bool]
    ) -> None:
        """Wait for every handler of the batch; on stop, give them ``shutdown_timeout_s``."""
        if not tasks:
            return
        everything = asyncio.ensure_future(asyncio.wait(tasks))
        await asyncio.wait([everything, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            await self._drain(tasks, self.config.shutdown_timeout_s)
        await everything

    def _rewind(self, span: BatchSpan) -> None:
        """Forget an aborted batch's offsets and fetch it again from its first offsets."""
        span.rewind(self.consumer)
        self.transactions_aborted += 1
        for tp in span.first:
            self._tracker.forget(tp)
            self._next_offset.pop(tp, None)

    def _record_lag(self) -> None:
        """Consumer lag per partition: the high watermark the last fetch reported minus the next
        offset this member will dispatch (records on the broker not yet taken up)."""
        consumer = self.consumer
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            nxt = self._next_offset.get(tp)
            if high is None or nxt is None:
                continue
            lag = max(0, high - nxt)
            self._metrics.lag.labels(self.config.group_id, tp.topic, str(tp.partition)).set(lag)

    async def _rewind_lost_logs(self) -> None:
        """A partition whose log ends below where this member reads has lost records (a memory
        broker restarted, a topic deleted and made again): read its topic's new log from the start.

        Kafka never reports a high watermark below an offset it handed out, nor commits past
        one; without this the member would wait at its old (or an old committed) position while
        the new log's records went unread. One partition found so stands for its whole topic: a
        partition of the new log that already holds as many records as the old one had looks
        whole, yet its records are new."""
        consumer = self.consumer
        assigned = consumer.assignment()
        for tp in assigned:
            high = consumer.highwater(tp)  # from the last fetch: known once one answered
            if high is None:
                continue
            at = self._next_offset.get(tp)
            if at is None:
                at = await consumer.position(tp)  # a fetch answered: the position is known
            if high < at:
                self._forget_lost_log(tp, at, high)
                self._lose_topic(tp.topic, assigned)
        todo = self._to_rewind & assigned
        if todo:
            await self._read_again_from_start(todo)

    def _lose_topic(self, topic: str, partitions: set[TopicPartition]) -> None:
        """Mark ``topic`` lost and ``partitions`` of it (this member's) to be read again."""
        rewind = {tp for tp in partitions if tp.topic == topic}
        if rewind:
            self._lost_topics.add(topic)
            self._to_rewind |= rewind

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._to_rewind = {tp for tp in assigned if tp.topic in self._lost_topics}

    async def _read_again_from_start(self, tps: set[TopicPartition]) -> None:
        """Seek ``tps`` to their log's start and commit that (their records are delivered
        again: handlers are idempotent); the topics are whole again once the commit went."""
        consumer = self.consumer
        try:
            starts: dict[TopicPartition, int] = await consumer.beginning_offsets(list(tps))
            for tp, start in starts.items():
                self._tracker.forget(tp)
                self._next_offset.pop(tp, None)
                consumer.seek(tp, start)
        except KafkaError as exc:  # revoked meanwhile (IllegalStateError), or the broker away
            log.info("%s: rewinding %s later (%r)", self.config.group_id, sorted(tps), exc)
            return
        self._to_rewind -= tps
        log.warning(
            "%s: reading %s again from the start (their topic's log was lost)",
            self.config.group_id,
            sorted(tps),
        )
        if self.transactional or await self._commit_offsets(starts):
            self._lost_topics -= {tp.topic for tp in tps}

    def _forget_lost_log(self, tp: TopicPartition, expected: int, found: int) -> None:
        """Drop what this member tracked of ``tp``'s old log (its unfinished work is delivered
        again, its commits would point into a log that is gone)."""
        log.warning(
            "%s: %s went back from offset %d to %d: the broker lost records (a restart of a "
            "memory broker?); reading its log again from the start",
            self.config.group_id,
            tp,
            expected,
            found,
        )
        self._tracker.forget(tp)
        self._next_offset.pop(tp, None)
        self.log_rewinds += 1

    def _dispatch(
        self, batch: dict[TopicPartition, list[Any]], span: BatchSpan | None = None
    ) -> None:
        consumer = self.consumer
        assigned = consumer.assignment()
        for tp, records in batch.items():
            if tp not in assigned:
                continue  # revoked while the poll was returning
            expected = self._next_offset.get(tp)
            if records and expected is not None and records[0].offset < expected:
                # aiokafka reset an out-of-range position to the start of a new log.
                self._forget_lost_log(tp, expected, records[0].offset)
                self._lose_topic(tp.topic, assigned - {tp})
            for i, rec in enumerate(records):
                if len(self._tasks) >= self.config.max_in_flight:
                    # Give the rest back: the next poll after a slot frees returns them again.
                    consumer.seek(tp, records[i].offset)
                    break
                epoch = self._tracker.add(tp, rec.offset)
                self._next_offset[tp] = rec.offset + 1
                if span is not None:
                    span.add(tp, rec.offset)
                task = asyncio.create_task(self._process(tp, rec, epoch))
                self._tasks[task] = tp
                task.add_done_callback(self._task_finished)
        n = len(self._tasks)
        self.max_seen_in_flight = max(self.max_seen_in_flight, n)
        self._metrics.in_flight.labels(self.config.group_id).set(n)

    def _task_finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._capacity.set()
        self._metrics.in_flight.labels(self.config.group_id).set(len(self._tasks))
        if not task.cancelled() and task.exception() is not None:
            # Not a handler failure (those are retried or dead-lettered) but a bug in the path
            # around it. Its offset can never be committed, which would stall the partition:
            # fail fast, so the process restarts and the record is delivered again.
            log.error(
                "%s: record task crashed; stopping the loop",
                self.config.group_id,
                exc_info=task.exception(),
            )
            if self.failure is None:
                self.failure = task.exception()
            self._stop_event.set()

    # --- one record --------------------------------------------------------------------------

    async def _process(self, tp: TopicPartition, rec: Any, epoch: int) -> None:
        ce = ConsumedEvent(
            topic=rec.topic,
            partition=rec.partition,
            offset=rec.offset,
            key=rec.key,
            headers={k: bytes(v) if v is not None else b"" for k, v in (rec.headers or ())},
            value=rec.value if rec.value is not None else b"",
            event=None,
            timestamp_ms=rec.timestamp,
        )
        limit = self.settings.max_message_bytes
        try:
            if len(ce.value) > limit:
                # Kafka hands out a batch larger than the fetch limit rather than stall, so an
                # oversize record (another producer's, a broker without the topic cap) arrives
                # anyway. Refuse it unread: the limit is what every stage sizes its memory by.
                info = ErrorInfo(
                    "oversize",
                    f"record of {len(ce.value)} bytes exceeds EPD_MAX_MESSAGE_BYTES={limit}",
                    field="value",
                )
                await self._dead_letter(ce, info, attempts=0)
            else:
                await self._decode_and_handle(ce)
        except _Abandoned:
            return
        self._tracker.done(tp, rec.offset, epoch)

    async def _decode_and_handle(self, ce: ConsumedEvent) -> None:
        try:
            ce.event = self._decode(ce.value)
        except Exception as exc:
            await self._dead_letter(ce, error_info(exc, code="undecodable"), attempts=0)
            return
        carrier = carrier_of(getattr(ce.event, "trace", None), ce.headers)
        rid = getattr(ce.event, "request_id", None)
        with stage_span(
            self.config.group_id,
            carrier,
            request_id=rid or ce.key_str,
            produced_ms=ce.timestamp_ms,
        ):
            await self._run_handler(ce)

    async def _run_handler(self, ce: ConsumedEvent) -> None:
        """Run the handler until it succeeds, or the retry policy gives up: then dead-letter."""
        failures = _Failures()
        attempt = 0
        while True:
            attempt += 1
            ce.attempt = attempt
            failure = await self._attempt(ce)
            if failure is None:
                return
            permanent = not self._is_transient(failure)
            infrastructure = not permanent and self._is_infrastructure(failure)
            failures.count(permanent=permanent, infrastructure=infrastructure)
            decision = self._policy.decide(
                permanent=permanent,
                infrastructure=infrastructure,
                handler_failures=failures.handler,
                infra_failures=failures.infrastructure,
                outage_s=failures.outage_s(),
                deadline_left_s=_deadline_left_s(ce.event),
            )
            if not decision.retry:
                info = error_info(failure, code=decision.code)
                await self._dead_letter(ce, info, attempts=ce.attempt)
                return
            self._log_retry(ce, failure, infrastructure, decision.delay_s)
            await self._sleep_unless_stopping(decision.delay_s)

    async def _attempt(self, ce: ConsumedEvent) -> Exception | None:
        """One try of the handler: None when it succeeded, else what it failed with."""
        group = self.config.group_id
        started = time.perf_counter()
        try:
            await self._handler(ce)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # we are being cancelled (shutdown, revoke): the offset stays open
            # The handler re-raised someone else's cancellation (an awaited future that was
            # cancelled). Treat it as a failure; swallowing it would stall the partition's
            # commits forever.
            failure: Exception = RuntimeError(
                "handler raised CancelledError without being cancelled"
            )
        except Exception as exc:
            failure = exc
        else:
            elapsed = time.perf_counter() - started
            self._metrics.handler_seconds.labels(group).observe(elapsed)
            self.processed += 1
            self._metrics.processed.labels(group).inc()
            log.info(
                "%s: handled %s[%d]@%d in %.1f ms",
                group,
                ce.topic,
                ce.partition,
                ce.offset,
                elapsed * 1000,
            )
            return None
        self._metrics.handler_seconds.labels(group).observe(time.perf_counter() - started)
        return failure

    def _log_retry(
        self, ce: ConsumedEvent, failure: Exception, infrastructure: bool, delay_s: float
    ) -> None:
        self.retried += 1
        self._metrics.retried.labels(self.config.group_id).inc()
        log.info(
            "%s: %s[%d]@%d attempt %d failed (%s%r); retrying in %.2fs",
            self.config.group_id,
            ce.topic,
            ce.partition,
            ce.offset,
            ce.attempt,
            "outage: " if infrastructure else "",
            failure,
            delay_s,
        )

    async def _sleep_unless_stopping(self, delay: float) -> None:
        """Back off; raise :class:`_Abandoned` if a stop is requested meanwhile."""
        if self._stop_event.is_set():
            raise _Abandoned
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop_event.wait(), delay)
        if self._stop_event.is_set():
            raise _Abandoned

    async def _dead_letter(self, ce: ConsumedEvent, info: ErrorInfo, *, attempts: int) -> None:
        """Publish the DLQ record (retrying until the broker takes it), then run the hook."""
        group = self.config.group_id
        original = envelope.Original(
            ce.topic, ce.partition, ce.offset, ce.key, ce.value, ce.headers
        )
        letter = envelope.dead_letter(original, info, attempts=attempts, group=group)
        self._metrics.errors.labels(group, info.code, info.rule or "").inc()
        log.warning(
            "%s: dead-lettering %s[%d]@%d after %d attempt(s): %s %s",
            group,
            ce.topic,
            ce.partition,
            ce.offset,
            attempts,
            info.code,
            info.message,
        )
        await self._publish_dead_letter(letter, ce.key)
        self.dead_lettered += 1
        self._metrics.dead_lettered.labels(group).inc()
        await self._report_dead_letter(ce, info)

    async def _publish_dead_letter(self, letter: DeadLetter, key: bytes | None) -> None:
        """Send ``letter`` until the broker takes it: one too large loses its payload (still in
        the source topic at its offset); a broker error is retried (the offset must not be
        committed without its dead letter), or, in a transaction, abandons the batch."""
        assert self._producer is not None
        group = self.config.group_id
        failures = 0
        while True:
            try:
                record = frame(letter, key, headers=envelope.envelope_headers(letter))
                await self._producer.send_and_wait(
                    self.config.dlq_topic,
                    value=record.value,
                    key=record.key,
                    headers=record.headers,
                )
                return
            except MessageSizeTooLargeError:
                if not letter.value:
                    raise
                letter = envelope.without_value(letter)
            except KafkaError as exc:
                if self.transactional:
                    # The transaction may be unusable now: abort the batch, deliver it again.
                    log.warning("%s: DLQ publish failed in a transaction (%r)", group, exc)
                    raise _Abandoned from exc
                failures += 1
                delay = backoff_delay(
                    failures, self.config.backoff_initial_s, self.config.backoff_max_s
                )
                log.warning("%s: DLQ publish failed (%r); retry in %.2fs", group, exc, delay)
                await self._sleep_unless_stopping(delay)

    async def _report_dead_letter(self, ce: ConsumedEvent, info: ErrorInfo) -> None:
        """The worker's own report of a dead letter (a ``rejected`` status); its failure is
        logged, never raised: the dead letter is out."""
        if self._on_dead_letter is None:
            return
        try:
            await self._on_dead_letter(ce, info)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: on_dead_letter hook failed", self.config.group_id)

    # --- commits, rebalance, shutdown -----------------------------------------------------------

    async def _maybe_commit(self) -> None:
        now = time.monotonic()
        if now - self._last_commit >= self.config.commit_interval_s:
            self._last_commit = now
            await self.commit()

    async def commit(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Commit what is done (in order) for ``tps`` or every partition; returns what went."""
        if self._consumer is None or self.transactional:
            return {}  # transactional: offsets are committed only inside their batch's transaction
        offsets = self._tracker.to_commit(tps)
        if not offsets or not await self._commit_offsets(offsets):
            return {}
        self._tracker.mark_committed(offsets)
        return offsets

    async def _commit_offsets(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit ``offsets`` as they are (bounded in time); False, logged, when it failed."""
        assert self._consumer is not None
        async with self._commit_lock:
            try:
                await asyncio.wait_for(self._consumer.commit(offsets), self.config.commit_timeout_s)
            except (KafkaError, TimeoutError) as exc:
                log.warning("%s: commit failed (%r); will retry", self.config.group_id, exc)
                return False
        return True

    async def _drain(self, tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
        """Let ``tasks`` finish within ``timeout_s``; cancel and reap the rest."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            log.warning(
                "%s: cancelled %d handler(s) still running; their records will be re-delivered",
                self.config.group_id,
                len(pending),
            )
            await asyncio.wait(pending)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        if self.transactional:
            # The running batch (one transaction) commits or aborts as a whole: let it finish
            # in time, else cancel it (it is then aborted and re-delivered to the new owner).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._batch_idle.wait(), self.config.revoke_timeout_s)
            if not self._batch_idle.is_set():
                for t in list(self._tasks):
                    t.cancel()
                await self._batch_idle.wait()
        tasks = [t for t, tp in self._tasks.items() if tp in revoked]
        await self._drain(tasks, self.config.revoke_timeout_s)
        await self.commit(revoked)
        for tp in revoked:
            self._tracker.forget(tp)
            self._next_offset.pop(tp, None)  # a later assignment starts from its committed offset
        self._paused_by_us -= revoked

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._drain(list(self._tasks), self.config.shutdown_timeout_s)
            await self.commit()
        finally:
            if self._consumer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._consumer.stop(), self.config.commit_timeout_s)
            if self._own_producer and self._producer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._producer.stop(), self.config.commit_timeout_s)
            self._metrics.in_flight.labels(self.config.group_id).set(0)
