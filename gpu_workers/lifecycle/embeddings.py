"""A request's embeddings: whether they are there, may still come, or never will; and the wait.

Waiting is an async store wait, so one slow request never blocks others. Where the embeddings
stand is judged before the wait and again every ``EPD_EMBEDDING_RECHECK_S`` of it: an entry
evicted or lost with a Redis restart sends no notification, and a first judgement may have been
"cannot tell", so a lost one ends the request (``embedding-lost``) within a recheck, not after
the whole wait.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING

from gpu_workers.entries import fetch_outputs, request_cancelled
from runtime.stores.errors import StoreTimeout, StoreUnavailable
from schemas.status_record import short_hash
from schemas.types import PrefillEvent, now_ms

if TYPE_CHECKING:
    from gpu_workers.compute import EncoderOutput
    from gpu_workers.lifecycle.admission import Admitted
    from gpu_workers.lifecycle.outcomes import Outcomes
    from runtime.reporting import RequestUpdates
    from runtime.status import CancelWatch, RequestState, RequestStateReader
    from runtime.stores.base import EmbeddingStore
    from schemas.families import ModelFamily


def embeddings_lost(missing: list[str], state: RequestState | None, created_ms: int) -> list[str]:
    """Of the ``missing`` item hashes, those whose embedding cannot come any more.

    An item the record says was encoded (or a cache hit) and is no longer in the store is lost
    (Redis evicted it, or the store restarted empty while the records survived). A request
    created before the Redis holding the records last started, whose record holds nothing from
    before that start, lost its record in a restart: everything of it kept in that Redis
    (embeddings, claim-checked inputs) is gone too, so each missing item is lost. ``state``
    None (Redis unreadable) decides nothing.
    """
    if state is None:
        return []
    since = state.records_since_ms
    if state.wiped and since is not None and created_ms < since:
        return list(missing)
    return [h for h in missing if short_hash(h) in state.encoded]


MARKS_WAIT_S = 0.5
"""Longest a completed request's outcome waits for the encoded marks of the items it waited
for (:meth:`EmbeddingWait.marks_landed`; they land a round trip after the embedding)."""


class Readiness(enum.Enum):
    """Where a request's embeddings stand once the first read did not find them all."""

    PRESENT = "present"
    """Every entry is in the store now: read them, nothing to wait for."""
    COMING = "coming"
    """Some are missing but may still arrive (or the store cannot tell): wait for them."""
    LOST = "lost"
    """One can never arrive (evicted after it was stored, or lost with a Redis restart)."""


class EmbeddingWait:
    """Gets an admitted request's embeddings, waiting for those the first read missed unless
    they cannot come any more. An ending on the way (lost, missing past the wait, cancelled)
    is reported through ``outcomes``."""

    def __init__(
        self,
        store: EmbeddingStore,
        family: ModelFamily,
        outcomes: Outcomes,
        *,
        wait_s: float,
        recheck_s: float,
        cancel: CancelWatch | None = None,
        request_state: RequestStateReader | None = None,
    ) -> None:
        """``request_state`` tells a lost embedding from one still coming (without it, a
        missing one is always waited for)."""
        self.store = store
        self.family = family
        self.outcomes = outcomes
        self.wait_s = wait_s
        self.recheck_s = recheck_s
        self.cancel = cancel
        self.request_state = request_state

    async def collect(
        self, ev: PrefillEvent, admitted: Admitted, updates: RequestUpdates
    ) -> list[EncoderOutput] | None:
        """Every entry of the request, in item order; None when the request ends here (an
        embedding lost or missing past the wait, a cancel: each reported). A store outage
        raises (the loop retries the event)."""
        if admitted.present is not None:
            return admitted.present
        timeout = self.wait_s
        if ev.deadline_ms is not None:
            timeout = max(0.0, min(timeout, (ev.deadline_ms - now_ms()) / 1000))
        if not await self._until_present(ev, admitted, timeout, updates):
            return None
        outputs, cancelled = await asyncio.gather(
            fetch_outputs(self.store, admitted.key_list, self.family),
            request_cancelled(self.cancel, ev.request_id),
        )
        if cancelled:
            await self.outcomes.cancelled(updates, "skipped before compute")
            return None
        return outputs

    async def _until_present(
        self, ev: PrefillEvent, admitted: Admitted, timeout_s: float, updates: RequestUpdates
    ) -> bool:
        """Wait up to ``timeout_s`` for the entries the first read missed: True once all are
        there; False when the request ended here (lost, missing past the wait, cancelled: each
        reported). A store outage that leaves them still coming raises (the loop retries).

        Where they stand is judged again every recheck of the wait, not only before it: a first
        judgement of "still coming" may have been "cannot tell" (a Redis just restarted
        answering a stale connection, a record unreadable for a moment), and an entry evicted
        or lost while the request waits sends no notification."""
        keys = admitted.keys
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            readiness, missing = await self._judge(ev, keys, updates)
            admitted.awaited = admitted.awaited or missing
            if readiness is Readiness.LOST:
                return False
            if readiness is Readiness.PRESENT:
                return True
            left = max(0.0, deadline - loop.time())
            slice_s = min(left, self.recheck_s)
            try:
                if not await self._wait_unless_cancelled(admitted.key_list, slice_s, ev.request_id):
                    # The encoder skips a cancelled request's items: nothing will come.
                    await self.outcomes.cancelled(updates, "skipped before compute")
                    return False
                return True
            except StoreUnavailable:
                # Redis went away under the wait. If it came back without the embeddings,
                # say so now rather than after a retry's full wait; else the loop retries.
                if await self.readiness(ev, keys, updates) is Readiness.LOST:
                    return False
                raise
            except StoreTimeout as exc:
                if slice_s >= left:
                    await self.outcomes.missing(ev, keys, set(exc.missing), timeout_s, updates)
                    return False

    async def _wait_unless_cancelled(
        self, keys: list[str], timeout_s: float, request_id: str
    ) -> bool:
        """The store wait for ``keys``, raced against a cancel of the request: True once they
        are all there, False when the request was cancelled first (StoreTimeout as ever)."""
        if self.cancel is None:
            await self.store.wait(keys, timeout_s)
            return True
        arrived = asyncio.ensure_future(self.store.wait(keys, timeout_s))
        cancelled = asyncio.ensure_future(self.cancel.wait(request_id))
        try:
            await asyncio.wait({arrived, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (arrived, cancelled):
                task.cancel()
            await asyncio.gather(arrived, cancelled, return_exceptions=True)
        if arrived.cancelled():
            return False  # the cancel came first
        arrived.result()  # StoreTimeout / StoreUnavailable raise here
        return True

    async def readiness(
        self, ev: PrefillEvent, keys: dict[str, str], updates: RequestUpdates
    ) -> Readiness:
        """Whether the request's embeddings are all in the store, may still come (also when
        the store cannot tell), or one of them never will (reported ``failed``,
        ``embedding-lost``, here). The record is read only when something is missing."""
        return (await self._judge(ev, keys, updates))[0]

    async def _judge(
        self, ev: PrefillEvent, keys: dict[str, str], updates: RequestUpdates
    ) -> tuple[Readiness, list[str]]:
        """:meth:`readiness`, and the items found missing (none when the store cannot tell)."""
        try:
            present = await asyncio.gather(*(self.store.exists(k) for k in keys.values()))
        except StoreUnavailable:
            return Readiness.COMING, []  # cannot tell; the wait (or its retry) decides
        missing = [h for h, ok in zip(keys, present, strict=True) if not ok]
        return await self._missing(ev, keys, missing, updates), missing

    async def _missing(
        self, ev: PrefillEvent, keys: dict[str, str], missing: list[str], updates: RequestUpdates
    ) -> Readiness:
        """Where the ``missing`` items stand (see :meth:`readiness`)."""
        if not missing:
            return Readiness.PRESENT
        if self.request_state is None:
            return Readiness.COMING
        state = await self.request_state(ev.request_id, since=True)
        lost = embeddings_lost(missing, state, ev.created_ms)
        if lost:
            # The record was read after the EXISTS above: an item stored and marked encoded in
            # between reads "encoded" while its key was missing then. Only a key still missing
            # now, after the record said encoded, is gone.
            try:
                again = await asyncio.gather(*(self.store.exists(keys[h]) for h in lost))
            except StoreUnavailable:
                return Readiness.COMING
            lost = [h for h, ok in zip(lost, again, strict=True) if not ok]
        if not lost:
            return Readiness.COMING
        await self.outcomes.lost(ev, lost, updates)
        return Readiness.LOST

    async def marks_landed(self, ev: PrefillEvent, admitted: Admitted) -> None:
        """Before the request's outcome: wait (at most ``MARKS_WAIT_S``) until the record
        shows the encoded marks of the items this request waited for. Their encoder writes a
        mark once it has stored the embedding, so a request that runs the moment the
        embedding lands could otherwise report its outcome before the record says its items
        were encoded. One record read in the usual case; none for a request whose embeddings
        were all there when it came in."""
        if not admitted.awaited or self.request_state is None:
            return
        wanted = {short_hash(h) for h in admitted.awaited}
        loop = asyncio.get_running_loop()
        deadline, pause = loop.time() + MARKS_WAIT_S, 0.002
        while True:
            state = await self.request_state(ev.request_id)
            if state is None or state.terminal or wanted <= state.encoded:
                return  # (None: Redis unreadable; the outcome goes on regardless)
            if loop.time() >= deadline:
                return  # the mark's write-through failed: the results collector folds it
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)
