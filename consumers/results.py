"""Results collector: ResultEvents -> status records (deduplicated, forward-only, with a TTL)."""

from __future__ import annotations

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

    async def handle(self, ev: ResultEvent) -> None:
        """Apply one stage update; a redelivered or out-of-date one changes nothing."""
        if await self.status.apply(ev):
            self.applied += 1
        else:
            self.duplicates += 1
