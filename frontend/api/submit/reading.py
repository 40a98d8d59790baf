"""Reading a request body: its content type, then its bytes within the size limit, the
deadline and the process's byte budget; parsing it off the event loop when it is large.

Bodies are held whole while they are parsed and rendered, so without a bound N concurrent
legal bodies cost N times the largest: memory grows with the load and the event loop and the
worker threads spend their time on bytes that will be refused anyway. So the body is counted
while it is read (a 50 MB upload is refused at the limit, never held whole), within its
deadline, and its bytes are reserved from the process's :class:`ByteBudget` before they are
held (a declared ``Content-Length`` up front, an undeclared length as it grows) and given back
when the request is done with them; a take that does not fit is refused at once (503 with
``Retry-After``), never queued, so a flood costs the process no more than the budget and the
other requests keep their latency.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from frontend.api.errors import ApiError, bad_request

JSON = "application/json"
MULTIPART = "multipart/form-data"
T = TypeVar("T")


def content_type(request: Request, *accepted: str) -> str:
    """The request's media type (lower case, no parameters) when it is one of ``accepted``;
    415 ``body.content_type`` otherwise."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in accepted:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send {' or '.join(accepted)}",
            rule="body.content_type",
        )
    return ctype


class ByteBudget:
    """``total`` bytes, taken and given back by the requests of one process (event loop only:
    no lock; takes and gives happen on the loop thread)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a byte budget needs at least one byte")
        self.total = total
        self.used = 0

    @property
    def free(self) -> int:
        """Bytes not taken."""
        return self.total - self.used

    def take(self, n: int) -> bool:
        """Take ``n`` bytes when they fit (True), else take nothing (False)."""
        if n < 0:
            raise ValueError("cannot take a negative number of bytes")
        if n > self.free:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        self.used = max(0, self.used - n)


@dataclass(slots=True)
class Reservation:
    """What one request holds of a :class:`ByteBudget`: it grows as the request needs more
    and goes back whole by :meth:`release` (idempotent)."""

    budget: ByteBudget
    held: int = 0

    def cover(self, n: int) -> bool:
        """Hold at least ``n`` bytes in all (take the difference); False when it does not fit
        (what was held stays held)."""
        more = n - self.held
        if more <= 0:
            return True
        if not self.budget.take(more):
            return False
        self.held = n
        return True

    def release(self) -> None:
        """Give everything held back."""
        self.budget.give(self.held)
        self.held = 0


SMALL_BODY_BYTES = 64 * 1024
"""Bodies up to this size reserve nothing from the body budget: they cost little, and small
requests keep working while big ones have spent it."""


@dataclass(frozen=True, slots=True)
class BodyRules:
    """How the API reads a body: at most ``max_bytes``, all of it within ``timeout_s``, its
    bytes reserved from the process's ``budget`` while they are held (see
    the module docstring)."""

    max_bytes: int
    timeout_s: float
    budget: ByteBudget
    retry_after_s: int = 1
    parsing: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    """Big bodies parse one at a time: JSON, base64 and pydantic hold the GIL (threads run
    them no faster side by side), and each parse waiting for it is one the event loop, and so
    ``/healthz``, would wait behind."""

    @classmethod
    def from_settings(cls, settings: Any) -> BodyRules:
        """The rules of ``EPD_API_MAX_BODY_BYTES``, ``EPD_API_BODY_TIMEOUT_S`` and
        ``EPD_API_BODY_BUDGET_BYTES`` (never below the largest body, which must fit alone)."""
        budget = max(settings.api_body_budget_bytes, settings.api_max_body_bytes)
        return cls(
            settings.api_max_body_bytes,
            settings.api_body_timeout_s,
            ByteBudget(budget),
            settings.api_retry_after_s,
        )

    @asynccontextmanager
    async def held(self, request: Request) -> AsyncIterator[bytes]:
        """The body, read under these rules; its bytes stay reserved until the block ends
        (put the parse and the render that hold them inside it)."""
        hold = Reservation(self.budget)
        try:
            yield await read_body(
                request,
                self.max_bytes,
                hold=hold,
                timeout_s=self.timeout_s,
                retry_after_s=self.retry_after_s,
            )
        finally:
            hold.release()


async def read_body(
    request: Request,
    limit: int,
    *,
    hold: Reservation | None = None,
    timeout_s: float | None = None,
    retry_after_s: int = 1,
) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes, 408 when
    it has not all arrived within ``timeout_s``, 503 when ``hold`` cannot cover it (its
    declared length before a byte is read, else as it grows past :data:`SMALL_BODY_BYTES`).
    None of them reads the rest of the body (the server discards it); 408 closes the
    connection."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request("Content-Length is not a number", rule="body.length")
        if int(declared) > limit:
            raise _body_too_large(int(declared), limit)
        _reserve(hold, int(declared), retry_after_s)
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise _body_too_large(total, limit)
                _reserve(hold, total, retry_after_s)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408,
            "timeout",
            f"the body did not arrive within {timeout_s:g} s ({total} bytes came; "
            "EPD_API_BODY_TIMEOUT_S)",
            rule="body.timeout",
            headers=dict(CLOSE),
        ) from None
    return b"".join(chunks)


CLOSE = {"Connection": "close"}
"""On the answer to a body too slow to wait for: the server closes the connection instead of
reading (and discarding) the rest. Refusals of a client that sends at speed (413, 503) keep
it: the server discards what it did not read (no memory; closed after the keep-alive
timeout at most), so the client reads the answer instead of a reset connection."""


def _reserve(hold: Reservation | None, size: int, retry_after_s: int) -> None:
    """``hold`` covers a body of ``size`` bytes (small ones need nothing), else 503."""
    if hold is None or size <= SMALL_BODY_BYTES or hold.cover(size):
        return
    budget = hold.budget
    raise ApiError(
        503,
        "unavailable",
        f"this server is holding {budget.used} bytes of other request bodies and has room "
        f"for {budget.free} more; this body needs {size} (EPD_API_BODY_BUDGET_BYTES is "
        f"{budget.total}); retry later",
        rule="body.budget",
        headers={"Retry-After": str(retry_after_s)},
    )


def replayed(request: Request, body: bytes) -> Request:
    """A request over the same scope whose body is ``body`` (already read and counted), for
    parsers that read the body themselves (``Request.form``): Starlette's public
    ``Request(scope, receive)`` with a ``receive`` that hands the bytes over once."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


def _body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        "too_large",
        f"body is at least {size} bytes; the limit is {limit}",
        rule="body.size",
    )


OFF_LOOP_BYTES = 64 * 1024
"""Bodies above this are parsed in a worker thread (JSON, base64, msgpack of megabytes)."""
FILE_WALK_SHARE = 8
"""An image file part counts an eighth of its bytes toward :data:`OFF_LOOP_BYTES`: its checks
walk its structure (a progressive JPEG's markers, some 0.3 us a KB; a PNG's chunks, less),
where a string is decoded whole. A 224² PNG is checked on the loop, not after two thread hops
that cost more than the check."""


async def off_the_loop(
    size: int, parse: Callable[..., T], *args: Any, slot: asyncio.Semaphore | None = None
) -> T:
    """``parse(*args)``, in a worker thread when the body is large (small ones parse faster
    here than a thread hop costs), holding ``slot`` there (``BodyRules.parsing``)."""
    if size <= OFF_LOOP_BYTES:
        return parse(*args)
    async with slot or contextlib.nullcontext():
        return await asyncio.to_thread(parse, *args)
