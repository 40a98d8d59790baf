"""The lost-log guard: a partition whose log went back is read again from its new start.

A memory broker (Tansu) that restarts, or a topic deleted and made again, starts its logs over.
Kafka never reports a high watermark below an offset it handed out, nor commits past one, so a
member reading such a partition would wait at its old (or an old committed) position while the
new log's records went unread. :class:`LostLogGuard`, called after each poll, notices a
partition whose log now ends below where this member reads, seeks it to its log's start and
commits that (the records are delivered again: handlers are idempotent).

One partition found so stands for its whole topic: a partition of the new log that already holds
as many records as the old one had looks whole, yet its records are new. The topic stays "lost"
until its start offsets are committed: the group's committed offsets may point into the log that
is gone (a commit sent before the loss was seen lands on the new log), so the partitions of it
assigned meanwhile are read again too.

Found a lost log, the guard also makes the pipeline's topics again (``remake_topics``): a memory
broker that restarted has none, its auto-created ones lack their partitions and message size,
and records sent to a topic before it is made are acknowledged and then lost.

The guard is opt-in (``ConsumeLoop(..., rewind_lost_logs=True)``): the stages turn it on with
interval commits. Without it the loop still drops what it tracked of a partition whose fetched
records start below where it read (:func:`forget_lost_log`), so its commits stay in order.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from consumers.commits import CommitTracker

log = logging.getLogger(__name__)

__all__ = ["LostLogGuard", "forget_lost_log"]


def forget_lost_log(
    group_id: str, tracker: CommitTracker[TopicPartition], tp: TopicPartition, at: int, found: int
) -> None:
    """Drop what this member tracked of ``tp``'s old log, read up to ``at`` and now found at
    ``found`` (its unfinished work is delivered again, its commits would point into a log that
    is gone)."""
    log.warning(
        "%s: %s went back from offset %d to %d: the broker lost records (a restart of a "
        "memory broker?); reading its log again from the start",
        group_id,
        tp,
        at,
        found,
    )
    tracker.forget(tp)


class LostLogGuard:
    """Finds partitions whose log was lost and reads their topics again from the start."""

    def __init__(
        self,
        group_id: str,
        tracker: CommitTracker[TopicPartition],
        commit: Callable[[dict[TopicPartition, int]], Awaitable[bool]],
        remake_topics: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self.group_id = group_id
        self.remake_topics = remake_topics
        """Makes the pipeline's topics again (their partitions and message size), once a lost
        log is found: a memory broker that restarted has none, and the records sent to a topic
        it has not made yet are acknowledged and then lost when it makes it."""
        self._remake_due = False
        self.rewinds = 0
        """Partitions found to have lost records and read again from the start."""
        self._tracker = tracker
        self._commit = commit
        self._lost_topics: set[str] = set()
        """Topics whose log the broker lost, until their start offsets are committed."""
        self._to_rewind: set[TopicPartition] = set()

    @property
    def pending(self) -> bool:
        """Whether partitions wait to be read again from the start (a rewind that failed is
        tried again after the next poll, so the loop must not sleep long)."""
        return bool(self._to_rewind)

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        """A new assignment: its partitions of lost topics are read again from the start."""
        self._to_rewind = {tp for tp in assigned if tp.topic in self._lost_topics}

    def went_back(
        self, tp: TopicPartition, at: int, found: int, assigned: set[TopicPartition]
    ) -> None:
        """A fetch of ``tp`` returned records from ``found``, below ``at`` where this member
        read (aiokafka reset an out-of-range position to the start of a new log)."""
        self._forget(tp, at, found)
        self._lose_topic(tp.topic, assigned - {tp})

    async def after_poll(self, consumer: AIOKafkaConsumer) -> None:
        """Check every assigned partition's log end against where this member reads, and read
        the lost ones (and the rest of their topics) again from the start."""
        assigned = consumer.assignment()
        for tp in assigned:
            high = consumer.highwater(tp)  # from the last fetch: known once one answered
            if high is None:
                continue
            at = self._tracker.next_offset(tp)
            if at is None:
                at = await consumer.position(tp)  # a fetch answered: the position is known
            if high < at:
                self._forget(tp, at, high)
                self._lose_topic(tp.topic, assigned)
        if self._remake_due:
            await self._remake()
        todo = self._to_rewind & assigned
        if todo:
            await self._read_again_from_start(consumer, todo)

    async def _remake(self) -> None:
        """Make the topics again (best effort: a failure is logged and tried after the next
        lost log; the broker's own auto-creation is the fallback)."""
        self._remake_due = False
        if self.remake_topics is None:
            return
        try:
            await self.remake_topics()
        except Exception as exc:  # the broker still starting, an admin call refused
            log.warning("%s: could not make the topics again (%r)", self.group_id, exc)

    def _forget(self, tp: TopicPartition, at: int, found: int) -> None:
        forget_lost_log(self.group_id, self._tracker, tp, at, found)
        self.rewinds += 1

    def _lose_topic(self, topic: str, partitions: set[TopicPartition]) -> None:
        """Mark ``topic`` lost and ``partitions`` of it (this member's) to be read again."""
        rewind = {tp for tp in partitions if tp.topic == topic}
        if topic not in self._lost_topics:
            self._remake_due = True
        if rewind:
            self._lost_topics.add(topic)
            self._to_rewind |= rewind

    async def _read_again_from_start(
        self, consumer: AIOKafkaConsumer, tps: set[TopicPartition]
    ) -> None:
        """Seek ``tps`` to their log's start and commit that; the topics are whole again once
        the commit went."""
        try:
            starts: dict[TopicPartition, int] = await consumer.beginning_offsets(list(tps))
            for tp, start in starts.items():
                self._tracker.forget(tp)
                consumer.seek(tp, start)
        except KafkaError as exc:  # revoked meanwhile (IllegalStateError), or the broker away
            log.info("%s: rewinding %s later (%r)", self.group_id, sorted(tps), exc)
            return
        self._to_rewind -= tps
        log.warning(
            "%s: reading %s again from the start (their topic's log was lost)",
            self.group_id,
            sorted(tps),
        )
        if await self._commit(starts):
            self._lost_topics -= {tp.topic for tp in tps}
