"""The record tasks a consume loop runs right now: one per record, each tied to its partition."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from aiokafka import TopicPartition

from consumers.metrics import ConsumerMetrics

log = logging.getLogger(__name__)

__all__ = ["InFlight"]


class InFlight:
    """Running record tasks by partition, with the waits a loop needs: a slot to free, a set of
    tasks to finish in time (the rest cancelled), every task of a batch.

    A task that crashes (not a handler failure: those are retried or dead-lettered, but a bug in
    the path around it) is reported to ``on_crash``: its offset can never be committed, which
    would stall the partition, so the loop must stop and the record be delivered again.
    """

    def __init__(
        self,
        group_id: str,
        metrics: ConsumerMetrics,
        on_crash: Callable[[BaseException], None],
    ) -> None:
        self.group_id = group_id
        self.max_seen = 0
        """The most tasks seen running at once (for tests and status pages)."""
        self._tasks: dict[asyncio.Task[None], TopicPartition] = {}
        self._slot_freed = asyncio.Event()
        self._gauge = metrics.in_flight.labels(group_id)
        self._on_crash = on_crash

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, tp: TopicPartition, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` (one record of ``tp``) as its own task."""
        task = asyncio.create_task(work)
        self._tasks[task] = tp
        task.add_done_callback(self._finished)

    def counted(self) -> None:
        """Publish the count after a dispatch (the gauge, the peak)."""
        n = len(self._tasks)
        self.max_seen = max(self.max_seen, n)
        self._gauge.set(n)

    def of(self, tps: Iterable[TopicPartition]) -> list[asyncio.Task[None]]:
        """The tasks of records of ``tps``."""
        wanted = set(tps)
        return [t for t, tp in self._tasks.items() if tp in wanted]

    def all(self) -> list[asyncio.Task[None]]:
        """Every running task."""
        return list(self._tasks)

    def slot_freed(self) -> asyncio.Future[Any]:
        """A future done once a task finishes from now on."""
        self._slot_freed.clear()
        return asyncio.ensure_future(self._slot_freed.wait())

    def cancel_all(self) -> None:
        """Cancel every running task."""
        for t in list(self._tasks):
            t.cancel()

    async def drain(self, tasks: list[asyncio.Task[None]], timeout_s: float) -> None:
        """Let ``tasks`` finish within ``timeout_s``; cancel and reap the rest."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
        for t in pending:
            t.cancel()
        if pending:
            log.warning(
                "%s: cancelled %d handler(s) still running; their records will be re-delivered",
                self.group_id,
                len(pending),
            )
            await asyncio.wait(pending)

    async def wait_all(self, stop_wait: asyncio.Future[Any], timeout_s: float) -> None:
        """Wait for every running task; once ``stop_wait`` is done, give them ``timeout_s``."""
        tasks = self.all()
        if not tasks:
            return
        everything = asyncio.ensure_future(asyncio.wait(tasks))
        await asyncio.wait([everything, stop_wait], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            await self.drain(tasks, timeout_s)
        await everything

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)
        self._slot_freed.set()
        self._gauge.set(len(self._tasks))
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: record task crashed; stopping the loop",
                self.group_id,
                exc_info=task.exception(),
            )
            self._on_crash(task.exception())  # type: ignore[arg-type]
