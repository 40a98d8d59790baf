"""One fetched batch as one Kafka transaction: outputs, dead letters and offsets commit together.

The consume loop's transactional mode (``EPD_KAFKA_TRANSACTIONS=true``) works in batches with a
barrier: fetch a batch, open a transaction, run the batch's handlers (concurrently, as usual),
wait for all of them, then add the batch's offsets to the transaction and commit it. Only a
batch whose every record finished (handled or dead-lettered) is committed; otherwise (a handler
abandoned at shutdown or revoke, a broker error) the transaction is aborted, the batch's
partitions are sought back to its first offsets, and the whole batch is delivered again. So a
committed transaction never holds outputs of a record whose offset is not in it, and a
``read_committed`` reader never sees outputs of an aborted or unfinished batch.

The trade-off: the next fetch waits for the slowest handler of the batch (no overlap between
batches), and a batch must finish within ``EPD_KAFKA_TRANSACTION_TIMEOUT_MS``.

:class:`TransactionalCommitter` is the loop's :class:`~consumers.commits.Committer` for this mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from consumers.commits import Batch, CommitTracker, LoopScope
from consumers.config import ConsumerConfig
from consumers.stopping import Abandoned
from runtime.kafka import is_transactional, make_transactional_producer, transactional_id
from runtime.settings import Settings

log = logging.getLogger(__name__)

__all__ = [
    "BatchSpan",
    "ProducerFenced",
    "TransactionalCommitter",
    "abort_quietly",
    "commit_batch",
]


@dataclass(slots=True)
class BatchSpan:
    """First and last offset of each partition in one dispatched batch."""

    first: dict[TopicPartition, int] = field(default_factory=dict)
    last: dict[TopicPartition, int] = field(default_factory=dict)

    def add(self, tp: TopicPartition, offset: int) -> None:
        """Record that ``offset`` of ``tp`` was dispatched in this batch."""
        self.first.setdefault(tp, offset)
        self.last[tp] = offset

    def __bool__(self) -> bool:
        return bool(self.last)

    def complete(self, committable: dict[TopicPartition, int]) -> bool:
        """Whether every dispatched record is done: each partition commits past its last one."""
        return all(committable.get(tp) == last + 1 for tp, last in self.last.items())

    def rewind(self, consumer: AIOKafkaConsumer) -> None:
        """Seek every still-assigned partition back to the batch's first offset."""
        assigned = consumer.assignment()
        for tp, offset in self.first.items():
            if tp in assigned:
                consumer.seek(tp, offset)


async def commit_batch(
    producer: AIOKafkaProducer, offsets: dict[TopicPartition, int], group_id: str
) -> None:
    """Add the batch's offsets to the open transaction and commit it."""
    await producer.send_offsets_to_transaction(offsets, group_id)
    await producer.commit_transaction()


async def abort_quietly(producer: AIOKafkaProducer, group_id: str) -> None:
    """Abort the transaction the caller opened; an error here is logged (the broker aborts it
    on timeout). A fence is raised: the caller must stop."""
    try:
        await producer.abort_transaction()
    except ProducerFenced:
        raise
    except Exception as exc:
        log.warning("%s: aborting the transaction failed (%r)", group_id, exc)


class TransactionalCommitter:
    """Runs each fetched batch as one Kafka transaction and commits its offsets inside it.

    A fence (another incarnation took our transactional id) is raised out of :meth:`run_batch`
    after the batch was sought back: the loop must stop, this process is a zombie.
    """

    in_transaction = True

    def __init__(self, config: ConsumerConfig, tracker: CommitTracker[TopicPartition]) -> None:
        self.transactions_committed = 0
        self.transactions_aborted = 0
        self._group = config.group_id
        self._revoke_timeout_s = config.revoke_timeout_s
        self._tracker = tracker
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._idle = asyncio.Event()
        """Clear while a batch (its transaction) runs."""
        self._idle.set()

    def check_producer(self, producer: AIOKafkaProducer) -> None:
        """The loop's producer must be the handlers' transactional one."""
        if not is_transactional(producer):
            raise ValueError(
                "EPD_KAFKA_TRANSACTIONS=true: the loop's producer must be transactional (the "
                "one the handlers' publisher sends with, from KafkaPublisher.for_pipeline(..., "
                "txn_id=...)), else their outputs would escape the transaction"
            )

    def new_producer(self, settings: Settings, group_id: str) -> AIOKafkaProducer:
        """A transactional producer with the group's transactional id."""
        return make_transactional_producer(settings, transactional_id(settings, group_id))

    def attach(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer) -> None:
        """Seek with ``consumer``, run the transactions on ``producer``."""
        self._consumer = consumer
        self._producer = producer

    async def run_batch(self, batch: Batch, loop: LoopScope) -> None:
        """Run ``batch`` inside one transaction, commit it with its offsets or abort it."""
        if not batch or loop.stopping:
            self._hand_back(batch)  # fetched as the stop came: undispatched
            return
        producer = self._producer
        assert producer is not None
        span = BatchSpan()
        self._idle.clear()
        began = False  # whether there is an open transaction to abort
        try:
            await producer.begin_transaction()
            began = True
            loop.dispatch(batch, span)
            await loop.wait_all()
            offsets = self._tracker.to_commit(span.last)
            if not span or not span.complete(offsets):
                raise Abandoned
            await commit_batch(producer, offsets, self._group)
            self._tracker.mark_committed(offsets)
            self.transactions_committed += 1
        except ProducerFenced:
            log.error("%s: producer fenced; stopping", self._group)
            self._rewind(span)
            raise
        except (Abandoned, KafkaError, TimeoutError) as exc:
            if not isinstance(exc, Abandoned):
                log.warning(
                    "%s: transaction failed (%r); the batch will be re-delivered", self._group, exc
                )
            try:
                if began:
                    await abort_quietly(producer, self._group)
            except ProducerFenced:
                self._rewind(span)
                raise
            self._rewind(span)
        finally:
            self._idle.set()

    def _hand_back(self, batch: Batch) -> None:
        """Seek the partitions of an undispatched ``batch`` back to its first records."""
        assert self._consumer is not None
        for tp, records in batch.items():
            if records and tp in self._consumer.assignment():
                self._consumer.seek(tp, records[0].offset)

    def _rewind(self, span: BatchSpan) -> None:
        """Forget an aborted batch's offsets and fetch it again from its first offsets."""
        assert self._consumer is not None
        span.rewind(self._consumer)
        self.transactions_aborted += 1
        for tp in span.first:
            self._tracker.forget(tp)

    async def after_round(self) -> None:
        """Nothing: a batch's offsets were committed (or not) with its transaction."""

    def owes(self) -> bool:
        """Never: a batch's offsets go with its transaction, before the next poll."""
        return False

    async def commit(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Nothing to commit outside a batch: offsets commit only inside its transaction."""
        return {}

    async def before_revoke(self, loop: LoopScope) -> None:
        """The running batch (one transaction) commits or aborts as a whole: let it finish in
        ``revoke_timeout_s``, else cancel it (it is then aborted and re-delivered to the new
        owner)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), self._revoke_timeout_s)
        if not self._idle.is_set():
            loop.cancel_all()
            await self._idle.wait()
