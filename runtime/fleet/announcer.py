"""A worker announcing itself while it runs, and touching its heartbeat file.

Every ``EPD_FLEET_ANNOUNCE_S`` the worker rewrites its announcement (partitions held, records in
flight and handled, when it last handled one) with a life of ``EPD_FLEET_TTL_S``; a clean stop
withdraws it, a crash lets it expire. The heartbeat file (``EPD_HEARTBEAT_FILE``, for a liveness
probe) is touched on the same beat while the consume loop runs, whether or not Redis answers: a
Redis outage is not a reason to restart a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from aiokafka import TopicPartition

from runtime.fleet.announcement import Announcement
from runtime.fleet.board import FleetBoard

log = logging.getLogger(__name__)


class LoopView(Protocol):
    """What the announcer reads of a consume loop (``consumers.loop.ConsumeLoop`` has it)."""

    @property
    def in_flight(self) -> int: ...

    @property
    def processed(self) -> int: ...

    @property
    def dead_lettered(self) -> int: ...

    @property
    def failure(self) -> BaseException | None: ...

    def assignment(self) -> set[TopicPartition]: ...


def _partitions(loop: LoopView) -> tuple[str, ...]:
    return tuple(sorted(f"{tp.topic}:{tp.partition}" for tp in loop.assignment()))


@dataclass
class Announcer:
    """Announces ``identity`` (an announcement whose counters this fills in) for ``loop``."""

    board: FleetBoard
    identity: Announcement
    loop: LoopView
    interval_s: float
    ttl_s: float
    heartbeat_file: Path | None = None
    clock: Callable[[], float] = time.time
    _handled: int = 0
    _last_handled_ms: int | None = None
    _task: asyncio.Task[None] | None = None

    def current(self) -> Announcement:
        """The announcement as of now."""
        now_ms = int(self.clock() * 1000)
        handled = self.loop.processed + self.loop.dead_lettered
        if handled != self._handled:
            self._handled, self._last_handled_ms = handled, now_ms
        return replace(
            self.identity,
            partitions=_partitions(self.loop),
            in_flight=self.loop.in_flight,
            handled=handled,
            last_handled_ms=self._last_handled_ms,
            announced_ms=now_ms,
            expires_ms=now_ms + int(self.ttl_s * 1000),
        )

    async def beat(self) -> None:
        """One beat: the heartbeat file (while the loop runs), then the announcement."""
        if self.heartbeat_file is not None and self.loop.failure is None:
            try:
                await asyncio.to_thread(_touch, self.heartbeat_file)
            except OSError as exc:  # the announcement still goes: the fleet sees the worker
                log.warning("%s: heartbeat file not touched: %r", self.identity.worker_id, exc)
        try:
            await self.board.announce(self.current())
        except Exception as exc:  # Redis away: the next beat tries again
            log.debug("%s: announcement not written: %r", self.identity.worker_id, exc)

    def start(self) -> None:
        """Beat in the background until :meth:`close`."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="fleet-announce")

    async def _run(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self.interval_s)

    async def close(self) -> None:
        """Stop beating and withdraw the announcement (best effort: a Redis that is away
        lets it expire instead)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.board.withdraw(self.identity.worker_id), 2.0)


def _touch(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    os.utime(path)
