"""What routes take through FastAPI dependencies: the shared state, the caller's tenant (from
the bearer token, also declared as the OpenAPI security scheme) and the records it owns.

Every dependency is ``async def``: FastAPI runs a plain ``def`` dependency in its thread pool,
a thread hop (and its locks) per dependency per request for work of a few microseconds."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from frontend.api.errors import ApiError, not_found
from frontend.api.state import ApiState
from schemas.status_record import StatusRecord

bearer = HTTPBearer(
    auto_error=False,
    description="a token of EPD_API_TOKENS (`Authorization: Bearer TOKEN`); an API started "
    "without tokens ignores it",
)


async def api_state(request: Request) -> ApiState:
    """The app's :class:`ApiState` (made in the lifespan)."""
    st: ApiState = request.app.state.api
    return st


State = Annotated[ApiState, Depends(api_state)]


async def caller_tenant(
    st: State, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
) -> str | None:
    """The caller's tenant (None on an open API); 401 for a missing or unknown token."""
    return st.tenants.identify(credentials.credentials if credentials else None)


Tenant = Annotated[str | None, Depends(caller_tenant)]


async def owned_record(request_id: str, st: State, tenant: Tenant) -> StatusRecord:
    """The caller's record of ``request_id``. Another tenant's request is "not found", not
    "forbidden": ids reveal nothing."""
    return check_owner(await st.status.get(request_id), request_id, tenant)


def check_owner(rec: StatusRecord | None, request_id: str, tenant: str | None) -> StatusRecord:
    """``rec`` when it is the caller's record of ``request_id``; else "not found"."""
    if rec is None or rec.tenant != tenant:
        raise not_found(request_id)
    return rec


OwnedRecord = Annotated[StatusRecord, Depends(owned_record)]


def _wait_query(what: str) -> Any:
    """The ``?wait=`` query parameter: seconds, at least 0 (the top is checked by the route's
    dependency, against ``EPD_API_MAX_WAIT_S``)."""
    return Query(ge=0, allow_inf_nan=False, description=what)


LongPollSeconds = Annotated[
    float,
    _wait_query(
        "long-poll up to this many seconds (at most EPD_API_MAX_WAIT_S) until the status changes"
    ),
]
SubmitWaitSeconds = Annotated[
    float,
    _wait_query(
        "hold the answer up to this many seconds (at most EPD_API_MAX_WAIT_S) until the "
        "request has finished: submit and wait in one call"
    ),
]


async def long_poll_wait(st: State, wait: LongPollSeconds = 0.0) -> float:
    """``?wait=``, within ``EPD_API_MAX_WAIT_S`` (checked before the record is looked up)."""
    return _bounded_wait(st, wait)


async def submit_wait(st: State, wait: SubmitWaitSeconds = 0.0) -> float:
    """A submit's ``?wait=``, within ``EPD_API_MAX_WAIT_S`` (checked before the body is read)."""
    return _bounded_wait(st, wait)


def _bounded_wait(st: ApiState, wait: float) -> float:
    if wait > st.limits.max_wait_s:
        raise ApiError(
            422,
            "validation_failed",
            f"wait is {wait:g} s; the limit is {st.limits.max_wait_s:g} (EPD_API_MAX_WAIT_S)",
            rule="request.wait",
            field="wait",
        )
    return wait


Wait = Annotated[float, Depends(long_poll_wait)]
SubmitWait = Annotated[float, Depends(submit_wait)]
