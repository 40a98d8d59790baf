"""A stage's status updates and outcomes: onto the results topic, and through to the record.

Every stage reports through :class:`ResultReporter` (one update: a ResultEvent on
``{prefix}.results`` keyed by its request, with a stable result id, and, where a status writer
is given, folded straight into the request's status record beside the send).
:class:`RequestUpdates` keeps one request's progress updates in order in the background, so a
stage's compute never waits for them. Apart from the Kafka clients (:mod:`runtime.kafka`): this
is what the stages say, not how records travel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypedDict, Unpack

from runtime.publisher import OutRecord, Publisher
from runtime.status.store import StatusGone
from runtime.tracing import current_trace_id
from schemas.types import ErrorInfo, ResultEvent

log = logging.getLogger(__name__)


class StatusWriter(Protocol):
    """Folds one update into the request's status record (``StatusStore.apply``); ``fields``
    (top-level record fields, such as the items the fan-out found cached) are set in the same
    write. Writers that are never given ``fields`` may leave the keyword out."""

    def __call__(
        self, ev: ResultEvent, /, *, fields: dict[str, Any] | None = None
    ) -> Awaitable[object]: ...


BatchStatusWriter = Callable[[Sequence[ResultEvent]], Awaitable[object]]
"""Folds several updates of one request into its record in one write
(``StatusStore.apply_all``)."""


RECORDED_HEADER = "epd-recorded"
"""Kafka header of an update its stage wrote through to the status record before sending it:
the results collector has nothing to fold for it (it folds only what a stage could not
write, Redis away or slow). Absent: fold it."""
RECORDED: tuple[str, bytes] = (RECORDED_HEADER, b"1")


def recorded_headers(recorded: bool) -> list[tuple[str, bytes]]:
    """The headers that say whether a record's update is in the status record already."""
    return [RECORDED] if recorded else []


def was_recorded(headers: Mapping[str, bytes]) -> bool:
    """Whether a consumed record's stage wrote its update through (:data:`RECORDED_HEADER`)."""
    return headers.get(RECORDED_HEADER) == RECORDED[1]


class UpdateFields(TypedDict, total=False):
    """What one status update carries besides its request and status
    (:meth:`ResultReporter.update`)."""

    token_ids: list[int] | None
    text: str | None
    error: ErrorInfo | None
    timings: dict[str, float] | None
    info: dict[str, str] | None


class ResultReporter:
    """Sends one stage's ResultEvents (status updates and outcomes) to the results topic.

    Each record carries a stable id in the :attr:`RESULT_ID_HEADER` Kafka header,
    ``{request_id}:{stage}:{status}``, so a downstream reader can drop duplicates (the results
    topic is at-least-once: a worker that crashes before committing sends its updates again).
    It is the same pair the status record dedupes by: one id per stage outcome of a request,
    however many times that outcome is sent.

    ``record`` (write-through, e.g. ``StatusStore.apply``): each update is folded into the
    request's status record directly, then sent, so a client polling the record sees it
    without waiting for the results collector's hop. The topic stays the durable record; an
    update the record took is sent with :data:`RECORDED_HEADER`, which tells the collector
    there is nothing left to fold, and one whose direct write failed (Redis away) is only
    logged here and folded by the collector. A record that is gone
    (:class:`~runtime.status.StatusGone`: the record store never makes one on an update) is
    logged at INFO and told to ``on_gone``, so the stage can stop working for a request nobody
    can read the outcome of.
    """

    RESULT_ID_HEADER = "epd-result-id"
    WRITE_THROUGH_TIMEOUT_S = 2.0

    @staticmethod
    def result_id(request_id: str, stage: str, status: str) -> str:
        """The stable id of one (request, stage, status) update."""
        return f"{request_id}:{stage}:{status}"

    def __init__(
        self,
        publisher: Publisher,
        results_topic: str,
        stage: str,
        worker: str = "",
        *,
        record: StatusWriter | None = None,
        record_all: BatchStatusWriter | None = None,
        on_gone: Callable[[ResultEvent], object] | None = None,
    ):
        self.publisher = publisher
        self.topic = results_topic
        self.stage = stage
        self.worker = worker
        self.record = record
        self.record_all = record_all
        """Writes a batch of updates through in one go (:meth:`many`); without it, one by
        one with ``record``."""
        self.on_gone = on_gone

    async def __call__(self, request_id: str, status: str, **fields: Unpack[UpdateFields]) -> None:
        """Publish one update for ``request_id`` (keyed by it, so a request stays ordered);
        ``fields`` as :meth:`update` takes them."""
        event = self.update(request_id, status, **fields)
        # Both must be done before the caller goes on: the caller's next update (or the event
        # it publishes next) must not overtake this one in the record. The record first: it is
        # what a waiting client sees, and the send says whether it took the update.
        await self.send(event, recorded=await self.write_through(event))

    async def many(self, request_id: str, updates: Sequence[tuple[str, UpdateFields]]) -> None:
        """Several updates of ``request_id`` at once, in order: written through together
        (``record_all``: one write) and then sent together (one wait for the broker's
        acknowledgements), where :meth:`__call__` would take a round trip of each per update."""
        events = [self.update(request_id, status, **fields) for status, fields in updates]
        if self.record_all is None:
            recorded = [await self.write_through(ev) for ev in events]
        else:
            recorded = [await self._write_all_through(events)] * len(events)
        await self.publisher.send_all(
            self.topic, [self._out(ev, rec) for ev, rec in zip(events, recorded, strict=True)]
        )

    def update(
        self,
        request_id: str,
        status: str,
        *,
        token_ids: list[int] | None = None,
        text: str | None = None,
        error: ErrorInfo | None = None,
        timings: dict[str, float] | None = None,
        info: dict[str, str] | None = None,
    ) -> ResultEvent:
        """The ResultEvent of one update of this stage (with the active trace's id in ``info``),
        for callers that send it and write it through separately (:meth:`send`,
        :meth:`write_through`)."""
        info = dict(info or {})
        trace_id = current_trace_id()
        if trace_id is not None:
            info.setdefault("trace_id", trace_id)  # the request's trace, on its status record
        return ResultEvent(
            request_id=request_id,
            stage=self.stage,
            status=status,
            token_ids=token_ids,
            text=text,
            error=error,
            timings=timings or {},
            info=info,
            worker=self.worker,
        )

    async def send(self, event: ResultEvent, *, recorded: bool = False) -> None:
        """Publish ``event`` to the results topic, keyed by its request, with its result id
        (and :data:`RECORDED_HEADER` when ``recorded``: the status record has it already)."""
        key, _, headers = self._out(event, recorded)
        await self.publisher.send(self.topic, key, event, headers=headers)

    def _out(self, event: ResultEvent, recorded: bool) -> OutRecord:
        """The record of ``event``: keyed by its request, with its result id (and
        :data:`RECORDED_HEADER` when ``recorded``)."""
        rid = self.result_id(event.request_id, self.stage, event.status)
        headers = [(self.RESULT_ID_HEADER, rid.encode()), *recorded_headers(recorded)]
        return event.request_id, event, headers

    async def write_through(
        self, event: ResultEvent, *, fields: dict[str, Any] | None = None
    ) -> bool:
        """Fold ``event`` into the status record now (with record ``fields`` in the same
        write); True once the record holds it (a duplicate too). Without a ``record`` writer,
        or on a failure (only logged: the results topic still carries the update), False."""
        if self.record is None:
            return False
        write = self.record(event) if fields is None else self.record(event, fields=fields)
        return await self._written(write, event)

    async def _write_all_through(self, events: Sequence[ResultEvent]) -> bool:
        """``events`` (of one request) folded into its record in one write; as
        :meth:`write_through` for each."""
        assert self.record_all is not None
        return await self._written(self.record_all(events), events[-1])

    async def _written(self, write: Awaitable[object], event: ResultEvent) -> bool:
        """Whether ``write`` (of ``event``, or of a batch ending with it) went through."""
        try:
            # Bounded: a frozen Redis must not hold the stage up; the topic carries the update.
            await asyncio.wait_for(write, self.WRITE_THROUGH_TIMEOUT_S)
            return True
        except StatusGone:
            # Not made again (it would lack its tenant and front); the topic still has it.
            log.info(
                "%s: the status record of %s is gone; its %s is not recorded there",
                self.stage,
                event.request_id,
                event.status,
            )
            if self.on_gone is not None:
                self.on_gone(event)
        except Exception as exc:  # any failure: the results topic still carries the update
            log.warning(
                "status write-through of %s %s failed (%r); the results topic carries it",
                event.request_id,
                event.status,
                exc,
            )
        return False


class RequestUpdates:
    """One request's updates from one stage, kept in order, without holding the stage up.

    :meth:`soon` queues a progress update (``prefilling``, ``decoding``) and returns: the stage
    goes on with its work while one background task writes the queue out. The record and the
    results topic see the updates in the order they were made; those that queued up while an
    earlier one was on its way go out together (:meth:`ResultReporter.many`: one record write
    and one wait for the broker). The first of them is held up to ``hold_s``
    (``EPD_STATUS_HOLD_MS``) for the ones behind it: a request that is done within it writes
    its progress and its outcome in one go, where each would cost a record write and a
    produce request. :meth:`now` (an outcome) ends the hold and returns once it and every
    earlier update are out. A background update that failed raises from the next :meth:`now` or
    :meth:`flush` (the updates queued behind it are not sent), so the consume loop retries the
    event exactly as if the update had failed in place.
    """

    def __init__(self, reporter: ResultReporter, request_id: str, *, hold_s: float = 0.0) -> None:
        self.reporter = reporter
        self.request_id = request_id
        self.hold_s = hold_s
        self._queue: list[tuple[str, UpdateFields]] = []
        self._sender: asyncio.Task[None] | None = None
        self._hold: asyncio.Event | None = None
        """Set to end the hold of the queued updates (:meth:`_held`)."""

    def soon(self, status: str, **fields: Unpack[UpdateFields]) -> None:
        """Queue one update after the earlier ones; return at once."""
        self._queue.append((status, fields))
        sender = self._sender
        # A sender that failed is kept, so that the next flush raises its failure.
        if sender is None or (sender.done() and not _failed(sender)):
            self._sender = asyncio.create_task(self._send_queued())

    async def _send_queued(self) -> None:
        """Write the queue out, oldest first, taking what queued meanwhile as one batch."""
        if self.hold_s > 0:
            await self._held()
        while self._queue:
            batch, self._queue = self._queue, []
            if len(batch) == 1:
                status, fields = batch[0]
                await self.reporter(self.request_id, status, **fields)
            else:
                await self.reporter.many(self.request_id, batch)

    async def _held(self) -> None:
        """Wait ``hold_s``, or less once :meth:`flush` asks for the updates."""
        self._hold = hold = asyncio.Event()
        timer = asyncio.get_running_loop().call_later(self.hold_s, hold.set)
        try:
            await hold.wait()
        finally:
            timer.cancel()
            self._hold = None

    async def now(self, status: str, **fields: Unpack[UpdateFields]) -> None:
        """One update, sent and recorded before this returns (earlier ones first)."""
        sender = self._sender
        if not self._queue and (sender is None or (sender.done() and not _failed(sender))):
            self._sender = None
            await self.reporter(self.request_id, status, **fields)  # nothing before it
            return
        self.soon(status, **fields)
        await self.flush()

    async def flush(self) -> None:
        """Wait for every update queued so far; raise the first failure among them."""
        if self._hold is not None:
            self._hold.set()
        while (sender := self._sender) is not None:
            try:
                await sender
            except BaseException:
                if self._sender is sender:
                    self._sender = None
                self._queue.clear()  # behind a failure: not sent (order would break)
                raise
            if self._sender is sender:
                self._sender = None

    async def abandon(self) -> None:
        """The stage failed or is being cancelled: end the updates still in flight quietly
        (a retry of the event sends them again; the record folds repeats away)."""
        sender, self._sender = self._sender, None
        self._queue.clear()
        if sender is None or sender.done():
            if sender is not None and not sender.cancelled():
                sender.exception()  # retrieved: the stage's own failure is the one that matters
            return
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender


def _failed(task: asyncio.Task[None]) -> bool:
    """Whether a finished ``task`` was cancelled or raised."""
    return task.cancelled() or task.exception() is not None
