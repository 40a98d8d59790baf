"""Results collector: ResultEvents -> status records (deduplicated, forward-only, with a TTL)."""

from __future__ import annotations

import asyncio
import logging

from runtime.status_store import StatusStore
from schemas.types import ResultEvent

log = logging.getLogger(__name__)


class ResultsCollector:
    """Folds every ResultEvent into the request's status record; plug into a ConsumeLoop."""

    def __init__(self, status: StatusStore) -> None:
        self.status = status
        self.applied = 0
        self.duplicates = 0
        # The consume loop runs records concurrently. Updates of one request (same key, same
        # partition, in offset order) are applied one at a time in arrival order, so a short
        # request's "decoding" is not overtaken by its "completed" and lost from its history.
        self._order: dict[str, tuple[asyncio.Lock, int]] = {}

    async def handle(self, ev: ResultEvent) -> None:
        """Apply one stage update; a redelivered or out-of-date one changes nothing."""
        rid = ev.request_id
        # Taken before the first await: asyncio.Lock grants waiters in the order they asked.
        lock, users = self._order.get(rid, (asyncio.Lock(), 0))
        self._order[rid] = (lock, users + 1)
        try:
            async with lock:
                if await self.status.apply(ev):
                    self.applied += 1
                else:
                    self.duplicates += 1
        finally:
            lock, users = self._order[rid]
            if users <= 1:
                del self._order[rid]
            else:
                self._order[rid] = (lock, users - 1)
