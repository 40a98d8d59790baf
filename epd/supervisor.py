"""Keeps ``epd stack``'s workers running: a worker that died is said on the console, taken out
of the fleet at once (so ``/readyz`` shows the gap instead of waiting out its announcement),
and started again after a backoff that grows while it keeps dying."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from epd.local_pipeline import WorkerDied

if TYPE_CHECKING:
    from epd.local_pipeline import WorkerProcesses
    from runtime.fleet.board import FleetBoard

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STEADY_S = 60.0
"""A worker that lived this long since its last start gets the first backoff again."""


@dataclass
class Supervisor:
    """Watches ``workers``; ``say`` prints to the operator; ``board`` (optional) is the fleet
    whose announcements of dead workers are expired."""

    workers: WorkerProcesses
    say: Callable[[str], None]
    board: FleetBoard | None = None
    check_s: float = 0.5
    _backoff: dict[int, float] = field(default_factory=dict)
    _started: dict[int, float] = field(default_factory=dict)
    _waiting: set[int] = field(default_factory=set)
    """Restarted workers not yet holding partitions."""

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            for index in self.workers.exited():
                await self._restart(index)
            self._note_back()
            await asyncio.sleep(self.check_s)

    async def _restart(self, index: int) -> None:
        kind, proc, log_path = self.workers.procs[index]
        died = WorkerDied(kind, proc.returncode, log_path)
        await self._expire(f"{kind}@", proc.pid)
        now = time.monotonic()
        if now - self._started.get(index, 0.0) > STEADY_S:
            self._backoff[index] = FIRST_BACKOFF_S
        delay = self._backoff.get(index, FIRST_BACKOFF_S)
        self.say(f"{died.summary}; restarting it in {delay:g} s")
        await asyncio.sleep(delay)
        self._backoff[index] = min(delay * 2, MAX_BACKOFF_S)
        self.workers.respawn(index)
        self._started[index] = time.monotonic()
        self._waiting.add(index)

    def _note_back(self) -> None:
        for index in list(self._waiting):
            if self.workers.ready_files[index].exists():
                self._waiting.discard(index)
                kind, proc, _ = self.workers.procs[index]
                self.say(f"the {kind} worker is back (pid {proc.pid}, holds partitions)")

    async def _expire(self, prefix: str, pid: int) -> None:
        """Expire the dead process's announcement (its id ends in ``:pid``)."""
        if self.board is None:
            return
        try:
            await self.board.expire(
                lambda a: a.worker_id.startswith(prefix) and a.worker_id.endswith(f":{pid}"),
                int(time.time() * 1000),
            )
        except Exception as exc:  # Redis away: the announcement expires on its own
            self.say(f"could not take the dead worker out of the fleet: {exc!r}")
