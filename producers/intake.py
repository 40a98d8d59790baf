"""The one way into the pipeline: request id, trace, admission, record, render, fan-out.

Every front hands its requests to an :class:`Intake`: the HTTP API's routes (native and vLLM),
the in-process :class:`producers.submitter.Submitter`, and any later front (OpenAI-compatible
routes) alike. A front only turns its own wire format into a :class:`Submission` (how to render
the request, whose it is, its sampling and labels) and the intake's answer back into its own
wire format. Idempotency, admission, request limits, tenant salts, the status record, the
render concurrency bound, the fan-out and failure recording belong to the intake, so no two
fronts can apply them differently.

A request is either fully enqueued or leaves nothing behind: a refusal before the fan-out sent
anything deletes the record it created (and gives back its in-flight slot and its
``Idempotency-Key``); a failure once events may be out records the request ``failed``, so no
record stays live. Once admitted, the work runs to its end even if the caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from producers.fanout import FanOut, FanoutStats
from producers.idempotency import IdempotencyStore
from producers.refusal import Refused
from runtime.request_limits import RequestLimits
from runtime.status import StatusStore
from runtime.tracing import TRACEPARENT, current_carrier, new_traceparent, stage_span, trace_id_of
from schemas.errors import ValidationError
from schemas.types import ErrorInfo, RenderEvent, ResultEvent, SamplingParams, now_ms

log = logging.getLogger("epd.intake")

OUTAGES: tuple[type[BaseException], ...] = (KafkaError, RedisError, OSError)
"""Failures of a dependency (broker, Redis, a socket), not of the request."""


def new_request_id() -> str:
    """A fresh request id (the only place one is made)."""
    return uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class RenderContext:
    """What the intake decided for a request before it is rendered."""

    request_id: str
    cache_salt: str | None
    """The salt the request runs with (the tenant's namespace, see ``salts``)."""
    sampling: SamplingParams
    deadline_ms: int | None


RenderFn = Callable[[RenderContext], Awaitable[RenderEvent]]
"""A front's renderer: the RenderEvent of one request (raises ``ValidationError`` to refuse)."""


@dataclass(slots=True)
class Submission:
    """One request as a front hands it over."""

    render: RenderFn | None = None
    event: RenderEvent | None = None
    """An already rendered request (instead of ``render``); it keeps its own id and salt."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    tenant: str | None = None
    cache_salt: str | None = None
    """The caller's own salt; the intake derives the one the request runs with."""
    deadline_ms: int | None = None
    metadata: dict[str, str] | None = None
    """Opaque labels kept on the status record."""
    front: dict[str, Any] | None = None
    """What the front keeps on the record to answer in its own wire format later (the OpenAI
    routes: which API made the request, the model name, parameters a response echoes); small,
    and written by the front's own code, never a client's."""
    foreign_labels: bool = False
    """The items' ``mm_hash`` come from another renderer (vLLM): labels, not store keys."""
    traceparent: str | None = None
    idempotency_key: str | None = None
    fingerprint: str = ""
    """The request's meaning, compared under ``idempotency_key``."""
    request_id: str | None = None
    decodes_media: bool = True
    """Whether ``render`` decodes images or videos. Only such renders take one of the
    intake's render slots: a text-only request never waits behind a slow image."""
    door_checked: bool = False
    """Its front held the body's sampling parameters and item counts to the intake's
    :class:`RequestLimits` already (each route does, in the raw body, before anything is
    decoded): the intake does not check them a second time. Every other bound is the
    intake's; and the workers hold what runs to the same limits whatever the intake checked."""

    @classmethod
    def rendered(cls, ev: RenderEvent) -> Submission:
        """A submission of an already rendered event."""
        return cls(
            event=ev,
            sampling=ev.sampling,
            cache_salt=ev.cache_salt,
            deadline_ms=ev.deadline_ms,
            traceparent=ev.trace.get(TRACEPARENT),
            request_id=ev.request_id,
        )


@dataclass(frozen=True, slots=True)
class Accepted:
    """The intake's answer: the request is enqueued (or was, under its Idempotency-Key)."""

    request_id: str
    status: str
    duplicate: bool = False
    event: RenderEvent | None = None
    stats: FanoutStats | None = None


class Admission(Protocol):
    """Whether a request may enter now (in-flight bound, backlog, a connected broker)."""

    async def admit(self, request_id: str) -> None:
        """Take ``request_id`` in, or raise :class:`Refused` (``throttled``/``unavailable``)."""
        ...

    async def release(self, request_id: str) -> None:
        """Give back what :meth:`admit` took, for a request that was not enqueued after all."""
        ...


class IntakeObserver(Protocol):
    """Where the intake reports outcomes and render times (the API's Prometheus metrics)."""

    def outcome(self, label: str) -> None: ...

    def rendered(self, seconds: float) -> None: ...


class _Unobserved:
    def outcome(self, label: str) -> None:
        pass

    def rendered(self, seconds: float) -> None:
        pass


SaltPolicy = Callable[[str | None, str | None], str | None]
"""``(tenant, client salt) -> the salt a request runs with``."""


def _verbatim(tenant: str | None, salt: str | None) -> str | None:
    return salt


def _items(ev: RenderEvent) -> list[dict[str, Any]]:
    return [{"modality": m, "index": i, "mm_hash": h} for m, i, h in ev.features.items()]


class Intake:
    """Takes requests in for every front (see the module docstring)."""

    def __init__(
        self,
        fanout: FanOut,
        status: StatusStore,
        *,
        limits: RequestLimits | None = None,
        idempotency: IdempotencyStore | None = None,
        admission: Admission | None = None,
        salts: SaltPolicy = _verbatim,
        render_concurrency: int | None = None,
        observer: IntakeObserver | None = None,
        span: str = "intake",
        retry_after_s: int = 1,
    ) -> None:
        self.fanout = fanout
        self.status = status
        self.limits = limits
        """Checked for every submission (None: a trusted caller, held to the workers' own)."""
        self.idempotency = idempotency
        self.admission = admission
        self.salts = salts
        self.observer: IntakeObserver = observer or _Unobserved()
        self.span = span
        self.retry_after_s = retry_after_s
        self.render_slots: asyncio.Semaphore | None = (
            asyncio.Semaphore(max(1, render_concurrency)) if render_concurrency else None
        )
        """Renders running at once (None: unbounded, for a trusted in-process caller)."""
        self.tasks: set[asyncio.Task[Any]] = set()

    async def submit(self, sub: Submission) -> Accepted:
        """Take one request in: ``Accepted``, or ``ValidationError`` / :class:`Refused`."""
        try:
            return await self._submit(sub)
        except ValidationError:
            self.observer.outcome("rejected")
            raise
        except Refused as refusal:
            self.observer.outcome(refusal.kind)
            raise

    async def _submit(self, sub: Submission) -> Accepted:
        if self.limits is not None:
            self.limits.check_submission(
                sub.sampling, sub.cache_salt, sub.metadata, sampling_checked=sub.door_checked
            )
        rid = sub.request_id or new_request_id()
        if sub.idempotency_key is not None:
            earlier = await self._claim(sub, rid)
            if earlier is not None:
                self.observer.outcome("duplicate")
                return earlier
        try:
            if self.admission is not None:
                await self.admission.admit(rid)
        except BaseException:
            await self._release_claim(sub, rid)
            raise
        task = asyncio.create_task(self._enqueue(rid, sub, _traceparent(sub)))
        self.tasks.add(task)
        task.add_done_callback(_settled)
        task.add_done_callback(self.tasks.discard)
        # The caller may go away (a closed connection): the enqueue runs to its end anyway.
        ev, stats = await asyncio.shield(task)
        self.observer.outcome("queued")
        return Accepted(rid, "queued", event=ev, stats=stats)

    async def _claim(self, sub: Submission, rid: str) -> Accepted | None:
        """The earlier request under the submission's key, or None once this one owns it."""
        if self.idempotency is None:
            raise RuntimeError("this intake has no idempotency store")
        key = sub.idempotency_key or ""
        self.idempotency.check_key(key)
        owned, found = await self.idempotency.claim(sub.tenant, key, sub.fingerprint, rid)
        if owned:
            return None
        rec = await self.status.get(found)
        return Accepted(found, rec.status if rec else "queued", duplicate=True)

    async def _release_claim(self, sub: Submission, rid: str) -> None:
        if sub.idempotency_key is not None and self.idempotency is not None:
            with contextlib.suppress(Exception):
                await self.idempotency.release(sub.tenant, sub.idempotency_key, rid)

    # ------------------------------------------------------------------ the enqueue, in phases

    async def _enqueue(
        self, rid: str, sub: Submission, traceparent: str
    ) -> tuple[RenderEvent, FanoutStats]:
        """Render and check (nothing stored yet), then record and fan out (the fan-out makes the
        record with its first write, or, without a record writer of its own, beside its plan)."""
        with stage_span(self.span, {TRACEPARENT: traceparent}, request_id=rid):
            try:
                ev, timing = (sub.event, None) if sub.event else await self._render(rid, sub)
                if self.limits is not None:
                    self.limits.check_event(ev, counted=sub.door_checked)
            except BaseException:
                await self._forget(rid, sub, None)
                raise
            fields = _record_fields(sub, traceparent, ev, timing)
            created: asyncio.Future[bool] | None = None
            opening: _Opening | None = None
            if self.fanout.record is not None:
                # The fan-out makes the record with its own update in it, once it has planned
                # (one write where the intake's queued and the fan-out's update took two).
                opening = _Opening(self.status, rid, fields)
            else:
                # The record is written while the fan-out plans (hashes, store lookups); the
                # fan-out waits for it before it sends anything.
                created = asyncio.ensure_future(self.status.create(rid, fields))
            try:
                ev.trace.update(current_carrier())  # the request's trace travels with its events
                stats = await self.fanout.publish(
                    ev, foreign_labels=sub.foreign_labels, after=created, opening=opening
                )
            except ValidationError:
                # Refused by the fan-out's plan, before anything was sent.
                await self._forget(rid, sub, created, opening)
                raise
            except BaseException as exc:
                await self._fail(rid, sub, created, exc)
                if isinstance(exc, OUTAGES):
                    raise Refused(
                        "unavailable",
                        f"cannot enqueue: {exc}",
                        rule="enqueue",
                        retry_after_s=self.retry_after_s,
                    ) from None
                raise
            if self.fanout.record is None:
                await self._note_cached(rid, stats)  # else the fan-out's write held them
            return ev, stats

    async def _render(self, rid: str, sub: Submission) -> tuple[RenderEvent, dict[str, Any]]:
        """The front's render under the concurrency bound, and its timing for the record."""
        if sub.render is None:
            raise RuntimeError("a Submission needs render or event")
        ctx = RenderContext(
            request_id=rid,
            cache_salt=self.salts(sub.tenant, sub.cache_salt),
            sampling=sub.sampling,
            deadline_ms=sub.deadline_ms,
        )
        slots = self.render_slots if sub.decodes_media else None
        async with slots or contextlib.nullcontext():
            started, t0 = now_ms(), time.perf_counter()
            ev = await sub.render(ctx)
            seconds = time.perf_counter() - t0
        self.observer.rendered(seconds)
        return ev, {"started_ms": started, "finished_ms": now_ms(), "ms": seconds * 1000}

    async def _note_cached(self, rid: str, stats: FanoutStats) -> None:
        """Which items were cache hits (for the status view; the request is enqueued already,
        so a failed write is logged, not answered as a failure)."""
        try:
            await self.status.update_fields(rid, {"cached": stats.cached})
        except Exception as exc:
            log.warning("request %s: cannot note its cache hits: %r", rid, exc)

    async def _forget(
        self,
        rid: str,
        sub: Submission,
        created: asyncio.Future[bool] | None,
        opening: _Opening | None = None,
    ) -> None:
        """Undo a request that was never enqueued: its record, in-flight slot and key."""
        if created is not None:
            await _settle(created)
            with contextlib.suppress(Exception):
                if not created.cancelled() and created.exception() is None and created.result():
                    await self.status.delete(rid)
        elif opening is not None and opening.made:
            with contextlib.suppress(Exception):
                await self.status.delete(rid)
        if self.admission is not None:
            with contextlib.suppress(Exception):
                await self.admission.release(rid)
        await self._release_claim(sub, rid)

    async def _fail(
        self,
        rid: str,
        sub: Submission,
        created: asyncio.Future[bool] | None,
        exc: BaseException,
    ) -> None:
        """Record a request whose fan-out may have begun as ``failed`` (terminal: no worker
        result can override it, and it no longer counts as in flight)."""
        if created is not None:
            await _settle(created)
        why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        failed = ResultEvent(
            rid, "api", "failed", error=ErrorInfo("enqueue_failed", f"enqueue failed: {why}")
        )
        with contextlib.suppress(Exception):
            await self.status.apply(failed)
        if self.admission is not None:
            with contextlib.suppress(Exception):
                await self.admission.release(rid)
        await self._release_claim(sub, rid)
        if not isinstance(exc, (*OUTAGES, asyncio.CancelledError)):
            log.error("request %s: enqueue failed", rid, exc_info=exc)


@dataclass(slots=True)
class _Opening:
    """The fan-out's first write, which makes the request's record with the fan-out's update
    in it (:data:`producers.fanout.OpeningWrite`); ``made`` once it did."""

    status: StatusStore
    request_id: str
    fields: dict[str, Any]
    made: bool = False

    async def __call__(self, update: ResultEvent, first_fields: dict[str, Any]) -> None:
        await self.status.create(
            self.request_id, self.fields, first=update, first_fields=first_fields
        )
        self.made = True


def _record_fields(
    sub: Submission, traceparent: str, ev: RenderEvent, render_timing: dict[str, Any] | None
) -> dict[str, Any]:
    """What the request's record starts with besides its status: owner, labels, items."""
    fields: dict[str, Any] = {
        "tenant": sub.tenant,
        "metadata": sub.metadata,
        "info": {"trace_id": trace_id_of(traceparent) or ""},
        "items": _items(ev),
        "prompt_tokens": len(ev.token_ids),
    }
    if sub.front is not None:
        fields["front"] = sub.front
    if render_timing is not None:
        fields["render"] = render_timing
    return fields


def _traceparent(sub: Submission) -> str:
    """The caller's ``traceparent`` when it is well formed; else this request starts a trace."""
    if trace_id_of(sub.traceparent) is None:
        return new_traceparent()
    return str(sub.traceparent)


async def _settle(fut: asyncio.Future[Any]) -> None:
    """Wait for a record write still in flight, ignoring how it ended (its own error is the
    lesser one: the caller handles the first failure)."""
    with contextlib.suppress(BaseException):
        await asyncio.shield(fut)


def _settled(task: asyncio.Task[Any]) -> None:
    """Mark the outcome of an enqueue retrieved: its caller may have left before it ended."""
    if not task.cancelled():
        task.exception()
