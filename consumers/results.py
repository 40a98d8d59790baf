"""Results collector: ResultEvents and EncodedEvents -> status records (deduplicated, forward-only).

It reads two topics in one consumer group: ``{prefix}.results`` (every stage's status updates)
and ``{prefix}.encoded`` (one EncodedEvent per encoded item, hit or miss). The second is what
lets a request's status say which of its items are encoded and which were cache hits.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from consumers.retry import default_is_transient
from runtime.status import StatusGone, StatusStore
from schemas.status_record import encoded_update
from schemas.types import EncodedEvent, ResultEvent

log = logging.getLogger(__name__)

STALL_WAIT_S = 30.0
"""How long a request's updates wait for an earlier one of it that failed to be tried again."""


class ResultsCollector:
    """Folds stage updates into the request's status record; plug into a ConsumeLoop."""

    def __init__(
        self,
        status: StatusStore,
        on_update: Callable[[], None] | None = None,
        *,
        is_transient: Callable[[BaseException], bool] = default_is_transient,
    ) -> None:
        self.status = status
        self.on_update = on_update
        """Called on every update taken (the sweep's poke: a request is moving)."""
        self.is_transient = is_transient
        """The consume loop's rule for what it tries again: only such a failure holds the
        request's later updates back (a dead-lettered one never comes back)."""
        self.applied = 0
        self.duplicates = 0
        self.recorded = 0
        """Updates their stage wrote through (not folded again)."""
        self.gone = 0
        """Updates of requests whose record went (never made again: see StatusStore)."""
        # The consume loop runs records concurrently. Updates of one request (same key, same
        # partition, in offset order) are applied one at a time in arrival order, so a short
        # request's "decoding" is not overtaken by its "completed" and lost from its history.
        self._order: dict[str, tuple[asyncio.Lock, int]] = {}
        # An update that failed (Redis out) is tried again by the loop, after its next ones
        # took the lock: they wait for it (up to STALL_WAIT_S), or an update that makes the
        # record (the router's, when its own write-through failed) would come after the
        # request's later updates, which would find no record and be dropped.
        self._stalled: dict[str, tuple[object, asyncio.Event]] = {}

    async def handle(self, ev: ResultEvent | EncodedEvent, *, recorded: bool = False) -> None:
        """Apply one update; a redelivered or out-of-date one changes nothing. ``recorded``: its
        stage wrote it through to the record already (``runtime.reporting.RECORDED_HEADER``),
        so there is nothing to fold; it still says the request is moving."""
        if self.on_update is not None:
            self.on_update()
        if recorded:
            self.recorded += 1
            return
        update = encoded_update(ev) if isinstance(ev, EncodedEvent) else ev
        rid = update.request_id
        # Taken before the first await: asyncio.Lock grants waiters in the order they asked.
        lock, users = self._order.get(rid, (asyncio.Lock(), 0))
        self._order[rid] = (lock, users + 1)
        try:
            await self._apply_in_order(rid, ev, lock, update)
        finally:
            lock, users = self._order[rid]
            if users <= 1:
                del self._order[rid]
            else:
                self._order[rid] = (lock, users - 1)

    async def _apply_in_order(
        self, rid: str, ev: object, lock: asyncio.Lock, update: ResultEvent
    ) -> None:
        while True:
            await self._after_stalled(rid, ev)
            async with lock:
                if self._stalled_by_another(rid, ev):
                    continue  # an earlier update failed while this one waited: it goes first
                try:
                    applied = await self.status.apply(update)
                except StatusGone:
                    # Expired, evicted or deleted before this update came: it stays gone (a
                    # record rebuilt from here would lack the tenant and front).
                    self._unstall(rid, ev)
                    self.gone += 1
                    log.debug("results: %s %s: its record is gone", rid, update.status)
                    return
                except Exception as exc:
                    if self.is_transient(exc):
                        self._stalled.setdefault(rid, (ev, asyncio.Event()))
                    raise
                self._unstall(rid, ev)
                if applied:
                    self.applied += 1
                else:
                    self.duplicates += 1
                return

    def _stalled_by_another(self, rid: str, ev: object) -> bool:
        stalled = self._stalled.get(rid)
        return stalled is not None and stalled[0] is not ev

    async def _after_stalled(self, rid: str, ev: object) -> None:
        """Wait for ``rid``'s update that failed and is to be tried again (not ``ev``)."""
        stalled = self._stalled.get(rid)
        if stalled is None or stalled[0] is ev:
            return
        try:
            await asyncio.wait_for(stalled[1].wait(), STALL_WAIT_S)
        except TimeoutError:
            # Dead-lettered or still failing: the updates behind it go on without it.
            if self._stalled.get(rid) is stalled:
                del self._stalled[rid]

    def _unstall(self, rid: str, ev: object) -> None:
        stalled = self._stalled.get(rid)
        if stalled is not None and stalled[0] is ev:
            del self._stalled[rid]
            stalled[1].set()
