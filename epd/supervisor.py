"""Keeps ``epd stack``'s workers running: a worker that died is said on the console, taken out
of the fleet at once (so ``/readyz`` shows the gap instead of waiting out its announcement),
and started again after a backoff that grows while it keeps dying. Each dead worker waits out
its own backoff: one worker dying again and again never holds back another's restart."""

from __future__ import annotations

import asyncio
import socket
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
    _due: dict[int, float] = field(default_factory=dict)
    """Dead workers -> when (monotonic) each is started again."""
    _waiting: set[int] = field(default_factory=set)
    """Restarted workers not yet holding partitions."""

    async def run(self) -> None:
        """Until cancelled; an error of its own is said before it ends (never silently)."""
        try:
            while True:
                await self.tick()
                await asyncio.sleep(self.check_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.say(f"the worker supervisor stopped: {exc!r}; dead workers stay dead")
            raise

    async def tick(self) -> None:
        """One look: note the newly dead, start those whose backoff is over, say who is back."""
        now = time.monotonic()
        for index in self.workers.exited():
            if index not in self._due:
                await self._died(index, now)
        for index, due in list(self._due.items()):
            if due <= now:
                del self._due[index]
                self.workers.respawn(index)
                self._started[index] = time.monotonic()
                self._waiting.add(index)
        self._note_back()

    async def _died(self, index: int, now: float) -> None:
        kind, proc, log_path = self.workers.procs[index]
        died = WorkerDied(kind, proc.returncode, log_path)
        await self._expire(f"{kind}@{socket.gethostname()}:{proc.pid}")
        if now - self._started.get(index, 0.0) > STEADY_S:
            self._backoff[index] = FIRST_BACKOFF_S
        delay = self._backoff.get(index, FIRST_BACKOFF_S)
        self._backoff[index] = min(delay * 2, MAX_BACKOFF_S)
        self._due[index] = now + delay
        self._waiting.discard(index)
        self.say(f"{died.summary}; restarting it in {delay:g} s")

    def _note_back(self) -> None:
        for index in list(self._waiting):
            if self.workers.ready_files[index].exists():
                self._waiting.discard(index)
                kind, proc, _ = self.workers.procs[index]
                self.say(f"the {kind} worker is back (pid {proc.pid}, holds partitions)")

    async def _expire(self, worker_id: str) -> None:
        """Expire the dead process's announcement (its id: ``kind@host:pid``, as
        ``epd.stages`` names a worker)."""
        if self.board is None:
            return
        try:
            await self.board.expire(lambda a: a.worker_id == worker_id, int(time.time() * 1000))
        except Exception as exc:  # Redis away: the announcement expires on its own
            self.say(f"could not take the dead worker out of the fleet: {exc!r}")
