"""Ordered offset commits for out-of-order work (pure logic, no Kafka client).

Handlers for one partition run concurrently and finish in any order, but Kafka's committed offset
means "everything before this is done". :class:`CommitTracker` keeps, per partition, the offsets
handed out in fetch order and which of them are done; the committable offset is the lowest
offset not yet done (or one past the last offset seen when all are done). Committing it can only
ever re-deliver unfinished work, never skip it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

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

    def forget(self, tp: TP) -> None:
        """Drop a partition's state (after it was revoked and its final commit attempted)."""
        self._parts.pop(tp, None)

    def partitions(self) -> list[TP]:
        """Partitions with state."""
        return list(self._parts)
