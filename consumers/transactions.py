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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import ProducerFenced

log = logging.getLogger(__name__)

__all__ = ["BatchSpan", "ProducerFenced", "abort_quietly", "commit_batch"]


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
