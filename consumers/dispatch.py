"""Fetched records to running tasks: the part of the consume loop a committer works through.

:class:`Dispatcher` starts one task per fetched record while the loop has free slots (the rest are
sought back for the next poll), registers each offset with the commit tracker, and, when the
record runner is done with it, marks the offset done. It is the
:class:`~consumers.commits.LoopScope` the loop hands its committer.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from consumers.commits import Batch, CommitTracker, OffsetNotes
from consumers.config import ConsumerConfig
from consumers.in_flight import InFlight
from consumers.lost_logs import LostLogGuard, forget_lost_log
from consumers.metrics import ConsumerMetrics
from consumers.runner import RecordRunner

__all__ = ["Dispatcher"]


class Dispatcher:
    """Runs each fetched record through ``runner`` as its own task, at most ``max_in_flight``."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        config: ConsumerConfig,
        *,
        tracker: CommitTracker[TopicPartition],
        in_flight: InFlight,
        runner: RecordRunner,
        guard: LostLogGuard | None,
        stop: asyncio.Event,
        metrics: ConsumerMetrics,
    ) -> None:
        self.consumer = consumer
        self.config = config
        self.went_back = 0
        """Partitions whose fetched records started below where this member read (no guard)."""
        self._tracker = tracker
        self._in_flight = in_flight
        self._runner = runner
        self._guard = guard
        self._stop = stop
        self._lag = metrics.lag

    @property
    def stopping(self) -> bool:
        """Whether a stop was requested."""
        return self._stop.is_set()

    def dispatch(self, batch: Batch, span: OffsetNotes | None = None) -> None:
        """Start a task per record of ``batch`` while there are free slots (the rest are sought
        back for the next poll), noting each in ``span``."""
        consumer = self.consumer
        assigned = consumer.assignment()
        for tp, records in batch.items():
            if tp not in assigned:
                continue  # revoked while the poll was returning
            at = self._tracker.next_offset(tp)
            if records and at is not None and records[0].offset < at:
                self._log_went_back(tp, at, records[0].offset, assigned)
            for i, rec in enumerate(records):
                if len(self._in_flight) >= self.config.max_in_flight:
                    # Give the rest back: the next poll after a slot frees returns them again.
                    consumer.seek(tp, records[i].offset)
                    break
                epoch = self._tracker.add(tp, rec.offset)
                if span is not None:
                    span.add(tp, rec.offset)
                self._in_flight.spawn(tp, self._process(tp, rec, epoch))
        self._in_flight.counted()
        self._record_lag()

    async def wait_all(self) -> None:
        """Wait for every running handler; on stop, give them ``shutdown_timeout_s``."""
        stop_wait = asyncio.ensure_future(self._stop.wait())
        try:
            await self._in_flight.wait_all(stop_wait, self.config.shutdown_timeout_s)
        finally:
            stop_wait.cancel()

    def cancel_all(self) -> None:
        """Cancel every running handler."""
        self._in_flight.cancel_all()

    async def _process(self, tp: TopicPartition, rec: Any, epoch: int) -> None:
        if await self._runner.run(rec):
            self._tracker.done(tp, rec.offset, epoch)

    def _log_went_back(
        self, tp: TopicPartition, at: int, found: int, assigned: set[TopicPartition]
    ) -> None:
        """A fetch of ``tp`` starts below where this member read: aiokafka reset an out-of-range
        position to the start of a new log."""
        if self._guard is not None:
            self._guard.went_back(tp, at, found, assigned)
            return
        forget_lost_log(self.config.group_id, self._tracker, tp, at, found)
        self.went_back += 1

    def _record_lag(self) -> None:
        """Consumer lag per partition: the high watermark the last fetch reported minus the next
        offset this member will dispatch (records on the broker not yet taken up)."""
        consumer = self.consumer
        for tp in consumer.assignment():
            high = consumer.highwater(tp)
            nxt = self._tracker.next_offset(tp)
            if high is None or nxt is None:
                continue
            lag = max(0, high - nxt)
            self._lag.labels(self.config.group_id, tp.topic, str(tp.partition)).set(lag)
