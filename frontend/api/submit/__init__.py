"""The one path of a request body to the intake, shared by every submit route.

:func:`submit_body` runs it, phase by phase, for a route's :class:`Door`:

1. **read** (:mod:`~frontend.api.submit.reading`): the content type (415), then the body,
   counted while it is read (413), within its deadline (408) and the process's byte budget
   (503), its bytes reserved until the request is handed over;
2. **parse**: the JSON text (:mod:`~frontend.api.submit.json_text`: depth, ``NaN``, lone
   surrogates, texts far over their limit refused from the raw bytes) or the form;
3. **check**: counts before pydantic copies the body, the schema, then the bounds of
   :class:`runtime.request_limits.RequestLimits` the body alone decides (the intake checks the
   rest);
4. **media**: image and video strings decoded, sized and sniffed before any decoder sees them
   (:mod:`~frontend.api.submit.media`); ``http(s)`` URLs are checked against the allow-list
   at the check and fetched in the render (:mod:`~frontend.api.submit.media_urls`);
5. **Submission**: the intake's, with the route's render, then ``Intake.submit``.

The doors: ``/v1/requests`` (:mod:`~frontend.api.submit.native`), the OpenAI-compatible
routes (:mod:`~frontend.api.submit.openai`, the conversation itself in
:mod:`~frontend.api.submit.conversation`) and ``/v1/vllm/generate``
(:mod:`~frontend.api.submit.vllm`). Parse, check and media of a large body run in a worker
thread (:func:`~frontend.api.submit.reading.off_the_loop`), one big body at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from fastapi.responses import JSONResponse
from starlette.requests import Request

from frontend.api.errors import ApiError, answered
from frontend.api.submit.reading import content_type, off_the_loop
from producers.intake import Accepted, Submission
from runtime.tracing import TRACEPARENT
from schemas.errors import ValidationError

if TYPE_CHECKING:
    from frontend.api.state import ApiState

API_PREFIX = "/v1"

P = TypeVar("P")
C = TypeVar("C")
I = TypeVar("I")  # noqa: E741 (the input, as P and C are the parsed and the checked body)


@dataclass(frozen=True, slots=True)
class SubmitHeaders:
    """What a submit route passes from the request's headers to the intake."""

    idempotency_key: str | None
    traceparent: str | None

    @classmethod
    def of(cls, request: Request) -> SubmitHeaders:
        return cls(request.headers.get("idempotency-key"), request.headers.get(TRACEPARENT))


class Door(Protocol[P, C, I]):
    """One route's phases of the path (see the module docstring)."""

    @property
    def accepts(self) -> tuple[str, ...]:
        """The content types the route takes."""
        ...

    async def parse(self, request: Request, ctype: str, body: bytes) -> P: ...

    def work_bytes(self, parsed: P, body_bytes: int) -> int:
        """What the check and media phases cost, in bytes of text to decode: the measure
        :func:`~frontend.api.submit.reading.off_the_loop` weighs a thread hop against."""
        ...

    def check(self, parsed: P) -> C: ...

    def media(self, checked: C) -> I: ...

    def submission(self, inp: I, tenant: str | None, headers: SubmitHeaders) -> Submission: ...

    def blame(self, inp: I, exc: ValidationError | ApiError) -> None:
        """Point an error of the render or the intake at what the client wrote."""


@dataclass(frozen=True, slots=True)
class Submitted(Generic[I]):
    """What the path gives the route: the intake's answer and the checked input."""

    accepted: Accepted
    input: I


async def submit_body(
    request: Request, st: ApiState, tenant: str | None, door: Door[P, C, I]
) -> Submitted[I]:
    """Read, parse, check, decode the media of and submit a request's body (see the module
    docstring). The body's bytes stay reserved until the intake has the submission: its
    render holds the media."""
    ctype = content_type(request, *door.accepts)
    slot = st.bodies.parsing
    async with st.bodies.held(request) as body:
        size = len(body)
        with answered():
            parsed = await door.parse(request, ctype, body)
            del body  # the parse holds what the render needs
            size = door.work_bytes(parsed, size)
            checked = await off_the_loop(size, door.check, parsed, slot=slot)
            inp = await off_the_loop(size, door.media, checked, slot=slot)
        sub = door.submission(inp, tenant, SubmitHeaders.of(request))
        try:
            accepted = await st.intake.submit(sub)
        except (ValidationError, ApiError) as exc:  # the render's, the fetch's, the intake's
            door.blame(inp, exc)
            raise
    return Submitted(accepted, inp)


def status_url(request_id: str) -> str:
    """Where a request's status is read (its ``Location``)."""
    return f"{API_PREFIX}/requests/{request_id}"


def accepted_response(accepted: Accepted) -> JSONResponse:
    """``202`` for a new request, ``200`` for one found again by its Idempotency-Key."""
    url = status_url(accepted.request_id)
    body = {
        "request_id": accepted.request_id,
        "status": accepted.status,
        "status_url": url,
        "events_url": f"{url}/events",
    }
    code = 200 if accepted.duplicate else 202
    return JSONResponse(body, status_code=code, headers={"Location": url})
