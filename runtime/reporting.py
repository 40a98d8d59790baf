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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypedDict, Unpack

from runtime.publisher import Publisher
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
        on_gone: Callable[[ResultEvent], object] | None = None,
    ):
        self.publisher = publisher
        self.topic = results_topic
        self.stage = stage
        self.worker = worker
        self.record = record
        self.on_gone = on_gone

    async def __call__(self, request_id: str, status: str, **fields: Unpack[UpdateFields]) -> None:
        """Publish one update for ``request_id`` (keyed by it, so a request stays ordered);
        ``fields`` as :meth:`update` takes them."""
        event = self.update(request_id, status, **fields)
        # Both must be done before the caller goes on: the caller's next update (or the event
        # it publishes next) must not overtake this one in the record. The record first: it is
        # what a waiting client sees, and the send says whether it took the update.
        await self.send(event, recorded=await self.write_through(event))

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
        rid = self.result_id(event.request_id, self.stage, event.status)
        headers = [(self.RESULT_ID_HEADER, rid.encode()), *recorded_headers(recorded)]
        await self.publisher.send(self.topic, event.request_id, event, headers=headers)

    async def write_through(
        self, event: ResultEvent, *, fields: dict[str, Any] | None = None
    ) -> bool:
        """Fold ``event`` into the status record now (with record ``fields`` in the same
        write); True once the record holds it (a duplicate too). Without a ``record`` writer,
        or on a failure (only logged: the results topic still carries the update), False."""
        if self.record is None:
            return False
        write = self.record(event) if fields is None else self.record(event, fields=fields)
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

    :meth:`soon` starts a progress update (``prefilling``, ``decoding``) in the background:
    the stage goes on with its work while the broker acknowledges it and the record takes it.
    Each update waits for the one before it, so the record and the results topic see them in
    the order they were made; :meth:`now` (an outcome) waits for every earlier one first.
    A background update that failed raises from the next :meth:`now` or :meth:`flush`, so the
    consume loop retries the event exactly as if the update had failed in place.
    """

    def __init__(self, reporter: ResultReporter, request_id: str) -> None:
        self.reporter = reporter
        self.request_id = request_id
        self._last: asyncio.Task[None] | None = None

    def soon(self, status: str, **fields: Any) -> None:
        """Start one update after the earlier ones; return at once."""
        before = self._last

        async def send_after() -> None:
            if before is not None:
                await before
            await self.reporter(self.request_id, status, **fields)

        self._last = asyncio.create_task(send_after())

    async def now(self, status: str, **fields: Any) -> None:
        """One update, sent and recorded before this returns (earlier ones first)."""
        await self.flush()
        await self.reporter(self.request_id, status, **fields)

    async def flush(self) -> None:
        """Wait for every update started so far; raise the first failure among them."""
        last, self._last = self._last, None
        if last is not None:
            await last

    async def abandon(self) -> None:
        """The stage failed or is being cancelled: end the updates still in flight quietly
        (a retry of the event sends them again; the record folds repeats away)."""
        last, self._last = self._last, None
        if last is None or last.done():
            if last is not None and not last.cancelled():
                last.exception()  # retrieved: the stage's own failure is the one that matters
            return
        last.cancel()
        with contextlib.suppress(BaseException):
            await last
