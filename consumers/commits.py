"""Ordered offset commits for out-of-order work, and the committers that make them durable.

Handlers for one partition run concurrently and finish in any order, but Kafka's committed offset
means "everything before this is done". :class:`CommitTracker` (pure logic, no Kafka client)
keeps, per partition, the offsets handed out in fetch order and which of them are done; the
committable offset is the lowest offset not yet done (or one past the last offset seen when all
are done). Committing it can only ever re-deliver unfinished work, never skip it.

A consume loop makes that progress durable through one :class:`Committer`, chosen once when the
loop is built: :class:`IntervalCommitter` (here) commits what is done every
``commit_interval_s`` and on revoke and shutdown; ``TransactionalCommitter``
(:mod:`consumers.transactions`) commits each fetched batch's offsets inside the Kafka transaction
that holds its outputs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from consumers.config import ConsumerConfig
from runtime.kafka import make_producer
from runtime.settings import Settings

log = logging.getLogger(__name__)

Batch = dict[TopicPartition, list[Any]]
"""What one fetch returned: records per partition, in offset order."""

TP = TypeVar("TP", bound=Hashable)
"""A partition identifier (aiokafka's ``TopicPartition`` in production)."""

_EPOCHS = itertools.count(1)


@dataclass(slots=True)
class _Partition:
    epoch: int
    order: deque[int] = field(default_factory=deque)  # offsets not yet committable, fetch order
    pending: set[int] = field(default_factory=set)  # offsets handed out and not done
    done: set[int] = field(default_factory=set)  # done offsets still behind a pending one
    first: int | None = None  # the first offset added: committing it would record no progress
    next_offset: int | None = None  # one past the last offset added
    committed: int | None = None  # last offset successfully committed


class CommitTracker(Generic[TP]):
    """Tracks in-flight offsets per partition and yields what may be committed, in order."""

    def __init__(self) -> None:
        self._parts: dict[TP, _Partition] = {}

    def add(self, tp: TP, offset: int) -> int:
        """Record ``offset`` as handed to a handler; returns the partition's epoch.

        Offsets of one partition must arrive in increasing order (gaps are fine: compaction and
        transaction markers leave them). Pass the epoch back to :meth:`done` so a task that
        outlived a revocation cannot complete an offset of a later assignment.
        """
        p = self._parts.get(tp)
        if p is None:
            p = self._parts[tp] = _Partition(epoch=next(_EPOCHS))
        if p.next_offset is not None and offset < p.next_offset:
            raise ValueError(
                f"offset {offset} for {tp} is below the next expected offset {p.next_offset}; "
                "offsets of one partition must be added in increasing order"
            )
        if p.first is None:
            p.first = offset
        p.order.append(offset)
        p.pending.add(offset)
        p.next_offset = offset + 1
        return p.epoch

    def done(self, tp: TP, offset: int, epoch: int | None = None) -> bool:
        """Mark ``offset`` finished. Returns False (and changes nothing) for an unknown offset,
        a forgotten partition, a repeated call, or a stale epoch."""
        p = self._parts.get(tp)
        if p is None or (epoch is not None and epoch != p.epoch) or offset not in p.pending:
            return False
        p.pending.discard(offset)
        p.done.add(offset)
        while p.order and p.order[0] in p.done:
            p.done.discard(p.order.popleft())
        return True

    def committable(self, tp: TP) -> int | None:
        """The offset to commit for ``tp`` (the next one to read), or None if none was seen."""
        p = self._parts.get(tp)
        if p is None:
            return None
        if p.order:
            return p.order[0]
        return p.next_offset

    def to_commit(self, tps: Iterable[TP] | None = None) -> dict[TP, int]:
        """Committable offsets that moved past the last commit (or, before the first commit,
        past the first offset seen), for ``tps`` (default: all)."""
        out: dict[TP, int] = {}
        for tp in self._parts if tps is None else tps:
            p = self._parts.get(tp)
            if p is None:
                continue
            off = self.committable(tp)
            floor = p.committed if p.committed is not None else p.first
            if off is not None and floor is not None and off > floor:
                out[tp] = off
        return out

    def mark_committed(self, offsets: dict[TP, int]) -> None:
        """Record a successful commit (offsets of forgotten partitions are ignored)."""
        for tp, off in offsets.items():
            p = self._parts.get(tp)
            if p is not None and (p.committed is None or off > p.committed):
                p.committed = off

    def in_flight(self, tp: TP | None = None) -> int:
        """Offsets handed out and not done, for one partition or in total."""
        if tp is not None:
            p = self._parts.get(tp)
            return len(p.pending) if p else 0
        return sum(len(p.pending) for p in self._parts.values())

    def pending_offsets(self, tp: TP) -> list[int]:
        """Not-done offsets of ``tp`` in increasing order."""
        p = self._parts.get(tp)
        return sorted(p.pending) if p else []

    def next_offset(self, tp: TP) -> int | None:
        """One past the last offset added for ``tp`` (where its reading goes on), or None."""
        p = self._parts.get(tp)
        return p.next_offset if p else None

    def forget(self, tp: TP) -> None:
        """Drop a partition's state (after it was revoked and its final commit attempted)."""
        self._parts.pop(tp, None)

    def partitions(self) -> list[TP]:
        """Partitions with state."""
        return list(self._parts)


class OffsetNotes(Protocol):
    """Where a dispatch notes each offset it started (a transaction's ``BatchSpan``)."""

    def add(self, tp: TopicPartition, offset: int) -> None:
        """Note that ``offset`` of ``tp`` was dispatched."""


class LoopScope(Protocol):
    """What a committer may ask of the consume loop it commits for."""

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""

    def dispatch(self, batch: Batch, span: OffsetNotes | None = None) -> None:
        """Start a handler task per record of ``batch`` (noting each in ``span``)."""

    async def wait_all(self) -> None:
        """Wait for every running handler (on stop, for ``shutdown_timeout_s``, then cancel)."""

    def cancel_all(self) -> None:
        """Cancel every running handler."""


class Committer(Protocol):
    """How a consume loop makes its progress durable; one kind per loop, chosen when it is built."""

    in_transaction: bool
    """Whether the handlers' outputs and the dead letters ride in a transaction with the offsets
    (then a failed send abandons the batch instead of being retried)."""
    transactions_committed: int
    transactions_aborted: int

    def check_producer(self, producer: AIOKafkaProducer) -> None:
        """Refuse (ValueError) a producer handed to the loop that cannot commit this way."""

    def new_producer(self, settings: Settings, group_id: str) -> AIOKafkaProducer:
        """The producer (for dead letters) the loop makes when it was given none."""

    def attach(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer) -> None:
        """The started clients to commit with."""

    async def run_batch(self, batch: Batch, loop: LoopScope) -> None:
        """Take one fetched batch: dispatch its records (and, transactional, see them through)."""

    async def after_round(self) -> None:
        """Called after each poll round (the interval commit, when it is due)."""

    def owes(self) -> bool:
        """Whether a commit is owed (work done and not yet committed): the loop then ends its
        rounds in time for :meth:`after_round` to make it."""

    async def commit(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Commit what is done for ``tps`` (default: all) now; returns what went."""

    async def before_revoke(self, loop: LoopScope) -> None:
        """Called before revoked partitions' handlers are drained and their offsets committed."""


class IntervalCommitter:
    """Commits what is done, in order, every ``commit_interval_s`` and on revoke and shutdown."""

    in_transaction = False
    transactions_committed = 0  # never opens one
    transactions_aborted = 0

    def __init__(self, config: ConsumerConfig, tracker: CommitTracker[TopicPartition]) -> None:
        self._group = config.group_id
        self._interval_s = config.commit_interval_s
        self._timeout_s = config.commit_timeout_s
        self._tracker = tracker
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        """Commits go one at a time: a lost log's start is committed after any sent before."""
        self._last = 0.0

    def check_producer(self, producer: AIOKafkaProducer) -> None:
        """Any producer will do: dead letters are sent on their own."""

    def new_producer(self, settings: Settings, group_id: str) -> AIOKafkaProducer:
        """A plain producer for the dead letters."""
        return make_producer(settings)

    def attach(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer) -> None:
        """Commit through ``consumer`` from now on."""
        self._consumer = consumer

    async def run_batch(self, batch: Batch, loop: LoopScope) -> None:
        """Dispatch the batch; its offsets are committed as its records finish."""
        loop.dispatch(batch)

    async def after_round(self) -> None:
        """Commit what is done once ``commit_interval_s`` passed since the last round that did."""
        now = time.monotonic()
        if now - self._last >= self._interval_s:
            self._last = now
            await self.commit()

    def owes(self) -> bool:
        """Whether offsets are done and not yet committed."""
        return bool(self._tracker.to_commit())

    async def commit(self, tps: set[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        """Commit what is done (in order) for ``tps`` or every partition; returns what went."""
        if self._consumer is None:
            return {}
        offsets = self._tracker.to_commit(tps)
        if not offsets or not await self.commit_offsets(offsets):
            return {}
        self._tracker.mark_committed(offsets)
        return offsets

    async def commit_offsets(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit ``offsets`` as they are (bounded in time); False, logged, when it failed."""
        assert self._consumer is not None
        async with self._lock:
            try:
                await asyncio.wait_for(self._consumer.commit(offsets), self._timeout_s)
            except (KafkaError, TimeoutError) as exc:
                log.warning("%s: commit failed (%r); will retry", self._group, exc)
                return False
        return True

    async def before_revoke(self, loop: LoopScope) -> None:
        """Nothing: the revoked partitions' handlers are drained and committed as they are."""
