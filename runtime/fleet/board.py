"""The fleet's board: one Redis hash of worker announcements (:mod:`runtime.fleet.announcement`).

Writers set their own field; readers take the whole hash in one ``HGETALL`` (a fleet is tens of
workers, not thousands). An entry carries its own expiry, since a hash field has none that every
supported Redis honours; a reader drops entries dead for longer than ``FORGET_AFTER_MS`` so the
hash never grows with the workers that came and went.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from runtime.fleet.announcement import Announcement
from schemas.keys import RedisKeys

log = logging.getLogger(__name__)

FORGET_AFTER_MS = 3_600_000
"""A worker not heard of for an hour is dropped from the board (until then it is listed as
last seen, which is what an operator asks after a crash)."""
BOARD_TTL_MS = 2 * FORGET_AFTER_MS
"""The hash itself goes once no worker has written for this long (a pipeline taken down)."""
MAX_ENTRIES = 4096
"""Entries a reader parses (more means a writer gone wrong: the rest are ignored)."""


@dataclass(frozen=True, slots=True)
class FleetRead:
    """The board at one moment: who is live, and who was heard of before."""

    live: tuple[Announcement, ...]
    gone: tuple[Announcement, ...]
    """Expired announcements not yet forgotten (newest first)."""

    def by_stage(self, stage: str) -> list[Announcement]:
        """The live workers of ``stage``."""
        return [a for a in self.live if a.stage == stage]

    def last_seen(self, stage: str) -> Announcement | None:
        """The most recent expired announcement of ``stage``, if any."""
        return next((a for a in self.gone if a.stage == stage), None)


class FleetBoard:
    """Reads and writes the announcements of one pipeline (``keys.prefix``)."""

    def __init__(self, client: Any, keys: RedisKeys) -> None:
        self.client = client
        self.key = keys.fleet

    async def announce(self, announcement: Announcement) -> None:
        """Set this worker's entry (and keep the hash from expiring while anyone writes)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, announcement.worker_id, announcement.to_json())
        pipe.pexpire(self.key, BOARD_TTL_MS)
        await pipe.execute()

    async def withdraw(self, worker_id: str) -> None:
        """Remove this worker's entry (a clean stop)."""
        await self.client.hdel(self.key, worker_id)

    async def expire(self, which: Callable[[Announcement], bool], now_ms: int) -> int:
        """End the live announcements ``which`` picks now (a supervisor saw the process die):
        they are listed as gone at once instead of after their TTL. How many it ended."""
        raw: dict[Any, Any] = await self.client.hgetall(self.key)
        ended = 0
        for field, value in raw.items():
            entry = Announcement.from_json(value)
            if entry is not None and entry.live(now_ms) and which(entry):
                await self.client.hset(self.key, field, replace(entry, expires_ms=now_ms).to_json())
                ended += 1
        return ended

    async def read(self, now_ms: int) -> FleetRead:
        """The live and recently gone workers; entries forgotten long ago are deleted."""
        raw: dict[Any, Any] = await self.client.hgetall(self.key)
        live: list[Announcement] = []
        gone: list[Announcement] = []
        forget: list[Any] = []
        for field, value in list(raw.items())[:MAX_ENTRIES]:
            entry = Announcement.from_json(value)
            if entry is None or now_ms - entry.expires_ms > FORGET_AFTER_MS:
                forget.append(field)
            elif entry.live(now_ms):
                live.append(entry)
            else:
                gone.append(entry)
        if forget:
            await self.client.hdel(self.key, *forget)
        live.sort(key=lambda a: (a.stage, a.worker_id))
        gone.sort(key=lambda a: a.expires_ms, reverse=True)
        return FleetRead(tuple(live), tuple(gone))
