"""The consume loop every worker runs: poll, backpressure, rebalance, shutdown.

A worker supplies an async handler for one decoded event; :class:`ConsumeLoop` fetches and runs
each record as its own task, and composes the parts that do the rest:

* **One record** (:class:`~consumers.runner.RecordRunner`): size check, decode, trace span, the
  handler, retries with backoff, and the dead letter
  (:class:`~consumers.dead_letters.writer.DeadLetterWriter`) when the record cannot be handled.
  It holds no consumer; it says whether the record's offset may count as done.
* **At-least-once.** Auto-commit is off. An offset is committed only after its handler returned
  (or its dead letter was acknowledged by the broker), and commits follow offset order per
  partition even when handlers finish out of order (:class:`~consumers.commits.CommitTracker`).
  Handlers must therefore be idempotent: a crash re-delivers whatever was not committed.
* **Commits** go through one :class:`~consumers.commits.Committer`, chosen here once:
  :class:`~consumers.commits.IntervalCommitter` every ``commit_interval_s`` and on revoke and
  shutdown, or, with ``EPD_KAFKA_TRANSACTIONS=true`` (Apache Kafka only),
  :class:`~consumers.transactions.TransactionalCommitter`: batches, each one Kafka transaction
  holding the handlers' outputs (sent through the loop's transactional producer, which must be
  the one their publisher uses), the dead letters and the offsets; a batch with an unfinished
  record is aborted and fetched again.
* **Concurrency and backpressure.** At most ``max_in_flight`` records run at once. At the limit
  the loop pauses every assigned partition (it keeps polling, so the group membership stays
  alive) and resumes when a slot frees. Records a poll returns beyond the free slots are given
  back with ``seek``, never dropped.
* **Lost logs** (opt-in, ``rewind_lost_logs=True``; :mod:`consumers.lost_logs`): after each poll,
  a partition whose log now ends below where this member reads (a memory broker restarted) is
  read again from its new start, its topic with it.
* **Idle** (:mod:`consumers.idle`): with nothing in flight and nothing to commit a poll waits
  ``idle_poll_timeout_ms`` instead of ``poll_timeout_ms``, and after
  ``EPD_KAFKA_FETCH_IDLE_AFTER_S`` without records the consumer's fetches wait up to
  ``EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS`` for the first record; the first record brings the
  stage's own fetch back.
* **Rebalance.** When partitions are revoked, their in-flight handlers get ``revoke_timeout_s``
  to finish; the rest are cancelled, and what is done is committed before the partitions go.
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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError
from prometheus_client import CollectorRegistry

from consumers.commits import Batch, Committer, CommitTracker, IntervalCommitter
from consumers.config import ConsumerConfig
from consumers.dead_letters.writer import DeadLetterWriter
from consumers.dispatch import Dispatcher
from consumers.idle import FetchParams, IdleFetch, PollPace
from consumers.in_flight import InFlight
from consumers.lost_logs import LostLogGuard
from consumers.metrics import ConsumerMetrics, metrics_for
from consumers.records import DeadLetterHook, Handler
from consumers.retry import default_is_infrastructure, default_is_transient
from consumers.runner import Classifier, RecordRunner
from consumers.transactions import ProducerFenced, TransactionalCommitter
from runtime.kafka import make_consumer, set_fetch, start_producer
from runtime.settings import Settings
from schemas import codec

log = logging.getLogger(__name__)

__all__ = ["ConsumeLoop"]


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


def _dead_letter_writer(
    config: ConsumerConfig,
    committer: Committer,
    stop: asyncio.Event,
    on_dead_letter: DeadLetterHook | None,
    metrics: ConsumerMetrics,
) -> DeadLetterWriter:
    """The loop's dead-letter writer (its sends in the batch's transaction, if there is one)."""
    return DeadLetterWriter(
        group_id=config.group_id,
        dlq_topic=config.dlq_topic,
        stop=stop,
        metrics=metrics,
        backoff_initial_s=config.backoff_initial_s,
        backoff_max_s=config.backoff_max_s,
        in_transaction=committer.in_transaction,
        on_dead_letter=on_dead_letter,
    )


def _lost_log_guard(
    config: ConsumerConfig,
    committer: Committer,
    tracker: CommitTracker[TopicPartition],
    wanted: bool,
    remake_topics: Callable[[], Awaitable[object]] | None,
) -> LostLogGuard | None:
    """The guard, committing a lost log's start through the interval committer (None when
    not ``wanted``)."""
    if not wanted:
        return None
    if not isinstance(committer, IntervalCommitter):
        raise ValueError(
            "rewind_lost_logs=True needs interval commits: the brokers that lose their logs "
            "(memory brokers such as Tansu) do no transactions"
        )
    return LostLogGuard(config.group_id, tracker, committer.commit_offsets, remake_topics)


def _idle_fetch(settings: Settings, config: ConsumerConfig) -> IdleFetch:
    """The loop's fetch (its stage's wait and min bytes) and the idle one it backs off to."""
    own = config.consumer_overrides
    active = FetchParams(
        int(own.get("fetch_max_wait_ms", settings.kafka_fetch_max_wait_ms)),
        int(own.get("fetch_min_bytes", 1)),
    )
    return IdleFetch(
        active, settings.kafka_idle_fetch_max_wait_ms, settings.kafka_fetch_idle_after_s
    )


class _Poller:
    """Fetches as many records as the loop has free slots for, pausing at the limit."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        config: ConsumerConfig,
        in_flight: InFlight,
        metrics: ConsumerMetrics,
        busy: Callable[[], bool],
        on_records: Callable[[], None],
    ) -> None:
        self.consumer = consumer
        self.config = config
        self.pace = PollPace(config.poll_timeout_ms, config.idle_poll_timeout_ms)
        self.busy = busy
        """Whether anything is owed (handlers running, offsets to commit, a rewind): the poll
        then ends in time for the interval commit; else it waits until something happens."""
        self.on_records = on_records
        """Called as a poll takes records, before aiokafka builds its next fetch."""
        self.pauses = 0
        self.paused_by_us: set[TopicPartition] = set()
        self._in_flight = in_flight
        self._paused_metric = metrics.paused.labels(config.group_id)

    async def poll(self, stop_wait: asyncio.Future[Any]) -> Batch | None:
        """Fetch as many records as there are free slots; when there are none, pause every
        assigned partition (new assignments too) but keep polling, so the member stays in the
        group, and wake as soon as a slot frees."""
        consumer = self.consumer
        free = self.config.max_in_flight - len(self._in_flight)
        waits: list[asyncio.Future[Any]] = []
        if free <= 0:
            self._pause(consumer)
            waits.append(self._in_flight.slot_freed())
        elif self.paused_by_us:
            still = self.paused_by_us & consumer.assignment()
            if still:
                consumer.resume(*still)
            self.paused_by_us.clear()
        return await self._fetch(stop_wait, max(1, free), waits)

    def _pause(self, consumer: AIOKafkaConsumer) -> None:
        to_pause = consumer.assignment() - consumer.paused()
        if to_pause:
            if not self.paused_by_us:  # a new pause episode, not a top-up after a rebalance
                self.pauses += 1
                self._paused_metric.inc()
            consumer.pause(*to_pause)
            self.paused_by_us |= to_pause

    async def _fetch(
        self,
        stop_wait: asyncio.Future[Any],
        max_records: int,
        extra_waits: Sequence[asyncio.Future[Any]],
    ) -> Batch | None:
        """One ``getmany``, given up when the loop stops (or an extra wait ends) first."""
        fetch = asyncio.ensure_future(self._take(self.pace.timeout_ms(self.busy()), max_records))
        try:
            await asyncio.wait(
                [fetch, stop_wait, *extra_waits], return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in extra_waits:
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
        result: Batch = fetch.result()
        return result

    async def _take(self, timeout_ms: int, max_records: int) -> Batch:
        batch: Batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        if batch:
            # In the step that consumed them: aiokafka builds the next fetch after it, so an
            # idle consumer's next fetch is already the stage's own (a short wait on Tansu).
            self.on_records()
        return batch


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
        rewind_lost_logs: bool = False,
        remake_topics: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.settings = settings
        self.config = config
        settings.require_transactions_possible()
        self._tracker: CommitTracker[TopicPartition] = CommitTracker()
        kind = TransactionalCommitter if settings.kafka_transactions else IntervalCommitter
        self._committer: Committer = kind(config, self._tracker)
        if producer is not None:
            self._committer.check_producer(producer)
        self._producer = producer
        self._own_producer = producer is None
        self._stop_event = asyncio.Event()
        self._metrics = metrics_for(registry)
        self._runner = RecordRunner(
            handler,
            group_id=config.group_id,
            decode=decode,
            classify=Classifier(is_transient, is_infrastructure),
            policy=config.retry_policy(),
            dead_letters=_dead_letter_writer(
                config, self._committer, self._stop_event, on_dead_letter, self._metrics
            ),
            max_message_bytes=settings.max_message_bytes,
            stop=self._stop_event,
            metrics=self._metrics,
        )
        self._in_flight = InFlight(config.group_id, self._metrics, self._fail)
        self._guard = _lost_log_guard(
            config, self._committer, self._tracker, rewind_lost_logs, remake_topics
        )
        self._consumer: AIOKafkaConsumer | None = None
        self._idle_fetch = _idle_fetch(settings, config)
        self._stop_wait: asyncio.Task[bool] | None = None
        self._poller: _Poller | None = None
        self._dispatcher: Dispatcher | None = None
        self._started = self._running = self._closed = False
        self._finished = asyncio.Event()
        self.assigned = asyncio.Event()
        """Set once this member first holds partitions (readiness for supervisors and tests)."""
        self.failure: BaseException | None = None
        """Set when a record task crashed outside the handler; run_forever then raises it."""

    # --- what callers read ---------------------------------------------------------------------

    @property
    def transactional(self) -> bool:
        """Whether each batch runs as one Kafka transaction (``EPD_KAFKA_TRANSACTIONS``)."""
        return self._committer.in_transaction

    @property
    def in_flight(self) -> int:
        """Handlers running (or waiting to retry) right now."""
        return len(self._in_flight)

    @property
    def processed(self) -> int:
        """Records handled successfully."""
        return self._runner.processed

    @property
    def retried(self) -> int:
        """Handler retries after transient failures."""
        return self._runner.retried

    @property
    def dead_lettered(self) -> int:
        """Records sent to the DLQ."""
        return self._runner.dead_letters.dead_lettered

    @property
    def max_seen_in_flight(self) -> int:
        """The most handlers seen running at once."""
        return self._in_flight.max_seen

    @property
    def pauses(self) -> int:
        """Times the loop paused fetching at ``max_in_flight``."""
        return self._poller.pauses if self._poller is not None else 0

    @property
    def log_rewinds(self) -> int:
        """Partitions found to have lost records and read again from the start."""
        went_back = self._dispatcher.went_back if self._dispatcher is not None else 0
        return went_back + (self._guard.rewinds if self._guard is not None else 0)

    @property
    def transactions_committed(self) -> int:
        return self._committer.transactions_committed

    @property
    def transactions_aborted(self) -> int:
        return self._committer.transactions_aborted

    def assignment(self) -> set[TopicPartition]:
        """Partitions this member holds now (empty before start)."""
        return set(self._consumer.assignment()) if self._consumer is not None else set()

    @property
    def consumer(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise RuntimeError("ConsumeLoop.start() has not run")
        return self._consumer

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the producer (for the DLQ) and join the consumer group."""
        if self._started:
            return
        if self._producer is None:
            self._producer = self._committer.new_producer(self.settings, self.config.group_id)
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
        self._attach(consumer)

    def _attach(self, consumer: AIOKafkaConsumer) -> None:
        """Hand the started clients to the parts that use them."""
        assert self._producer is not None
        self._consumer = consumer
        self._committer.attach(consumer, self._producer)
        self._poller = _Poller(
            consumer,
            self.config,
            self._in_flight,
            self._metrics,
            busy=self._owes,
            on_records=lambda: self._switch_fetch(busy=True),
        )
        self._dispatcher = Dispatcher(
            consumer,
            self.config,
            tracker=self._tracker,
            in_flight=self._in_flight,
            runner=self._runner,
            guard=self._guard,
            stop=self._stop_event,
            metrics=self._metrics,
        )
        self._runner.dead_letters.producer = self._producer
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
        self._stop_wait = asyncio.create_task(self._stop_event.wait())
        try:
            while not self._stop_event.is_set():
                await self._round()
        finally:
            self._stop_wait.cancel()
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

    def _fail(self, exc: BaseException) -> None:
        """Stop the loop because of ``exc`` (the first one is what run_forever raises)."""
        if self.failure is None:
            self.failure = exc
        self._stop_event.set()

    async def _shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._in_flight.drain(self._in_flight.all(), self.config.shutdown_timeout_s)
            await self._committer.commit()
        finally:
            if self._consumer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._consumer.stop(), self.config.commit_timeout_s)
            if self._own_producer and self._producer is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._producer.stop(), self.config.commit_timeout_s)
            self._metrics.in_flight.labels(self.config.group_id).set(0)

    # --- one round: poll, hand the batch to the committer, guard, commit -----------------------

    async def _round(self) -> None:
        assert self._poller is not None and self._dispatcher is not None
        assert self._stop_wait is not None
        batch = await self._poller.poll(self._stop_wait)
        try:
            if batch is not None:
                await self._committer.run_batch(batch, self._dispatcher)
        except ProducerFenced as exc:
            # Another incarnation with our transactional id took over: this one is a zombie.
            self._fail(exc)
            return
        if self._guard is not None:
            await self._guard.after_poll(self.consumer)
        await self._committer.after_round()
        self._switch_fetch(busy=bool(batch) or self._owes())

    def _switch_fetch(self, *, busy: bool) -> None:
        """The consumer's fetch as :class:`~consumers.idle.IdleFetch` wants it now."""
        switch = self._idle_fetch.observe(busy)
        if switch is not None:
            set_fetch(self.consumer, wait_ms=switch.wait_ms, min_bytes=switch.min_bytes)

    def _owes(self) -> bool:
        """Whether anything is owed: handlers running, done offsets not yet committed, a lost
        log still to read again (an idle loop sleeps until a record or a stop comes)."""
        return (
            len(self._in_flight) > 0
            or self._committer.owes()
            or (self._guard is not None and self._guard.pending)
        )

    # --- rebalance -----------------------------------------------------------------------------

    async def commit(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Commit what is done (in order) for ``tps`` or every partition; returns what went
        (nothing with transactions: offsets commit only inside their batch's transaction)."""
        return await self._committer.commit(tps)

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        assert self._dispatcher is not None  # rebalances come with polls, after start
        await self._committer.before_revoke(self._dispatcher)
        await self._in_flight.drain(self._in_flight.of(revoked), self.config.revoke_timeout_s)
        await self._committer.commit(revoked)
        for tp in revoked:
            self._tracker.forget(tp)  # a later assignment starts from its committed offset
        if self._poller is not None:
            self._poller.paused_by_us -= revoked

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        if self._guard is not None:
            self._guard.on_assigned(assigned)
