"""The HTTP side of a submission, shared by the submit routes: the headers the intake takes
(``Idempotency-Key``, ``traceparent``) and its answer as ``202``/``200 Accepted``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.responses import JSONResponse
from starlette.requests import Request

from producers.intake import Accepted
from runtime.tracing import TRACEPARENT

API_PREFIX = "/v1"
OFF_LOOP_BYTES = 64 * 1024
"""Bodies above this are parsed in a worker thread (JSON, base64, msgpack of megabytes)."""
T = TypeVar("T")


async def off_the_loop(
    size: int, parse: Callable[..., T], *args: Any, slot: asyncio.Semaphore | None = None
) -> T:
    """``parse(*args)``, in a worker thread when the body is large (small ones parse faster
    here than a thread hop costs), holding ``slot`` there (``BodyRules.parsing``)."""
    if size <= OFF_LOOP_BYTES:
        return parse(*args)
    async with slot or contextlib.nullcontext():
        return await asyncio.to_thread(parse, *args)


@dataclass(frozen=True, slots=True)
class SubmitHeaders:
    """What a submit route passes from the request's headers to the intake."""

    idempotency_key: str | None
    traceparent: str | None

    @classmethod
    def of(cls, request: Request) -> SubmitHeaders:
        return cls(request.headers.get("idempotency-key"), request.headers.get(TRACEPARENT))


def accepted_response(accepted: Accepted) -> JSONResponse:
    """``202`` for a new request, ``200`` for one found again by its Idempotency-Key."""
    url = f"{API_PREFIX}/requests/{accepted.request_id}"
    body = {
        "request_id": accepted.request_id,
        "status": accepted.status,
        "status_url": url,
        "events_url": f"{url}/events",
    }
    code = 200 if accepted.duplicate else 202
    return JSONResponse(body, status_code=code, headers={"Location": url})
