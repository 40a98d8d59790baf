"""``/v1/requests``: submit (render + fan-out), poll and long-poll, events, cancel."""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from redis.exceptions import RedisError

from frontend.api.cancels import cancel_owned
from frontend.api.deps import (
    OwnedRecord,
    State,
    SubmitWait,
    Tenant,
    Wait,
    check_owner,
    owned_record,
)
from frontend.api.errors import bad_request
from frontend.api.events import SSE_EVENT_SCHEMA, event_stream, is_stream_id, record_gone
from frontend.api.openapi import SUBMIT_BODY, submit_operation, with_errors
from frontend.api.protocol import ERROR_RESPONSES, RequestStatus
from frontend.api.submit import accepted_response, status_url, submit_body
from frontend.api.submit.native import NativeDoor
from frontend.api.views import status_view
from schemas.statuses import Status

log = logging.getLogger("epd.api")

router = APIRouter(prefix="/v1", tags=["requests"])


@router.post(
    "/requests",
    **submit_operation(SUBMIT_BODY, waits=True),
    summary="Submit a request (render + enqueue); answers 202 without waiting for a GPU, or "
    "with ?wait=SECONDS its status once it has finished (submit and wait in one call)",
)
async def submit(request: Request, st: State, tenant: Tenant, wait: SubmitWait) -> JSONResponse:
    accepted = (await submit_body(request, st, tenant, NativeDoor(st))).accepted
    if wait <= 0:
        return accepted_response(accepted)
    # The request runs whatever happens to this call; the wait only holds the answer.
    try:
        rec = await st.notifier.wait_change(accepted.request_id, None, wait, until_done=True)
    except (RedisError, OSError) as exc:
        # The request is in: an outage during the wait answers what a submit without one
        # would, never a 503 (which a client retries as a refusal: a second request).
        log.warning("request %s: its wait ended early (%r)", accepted.request_id, exc)
        return accepted_response(accepted)
    if rec is None:
        return accepted_response(accepted)  # its record went meanwhile (an operator, its TTL)
    return JSONResponse(
        status_view(rec),
        status_code=200 if rec.terminal else 202,
        headers={"Location": status_url(accepted.request_id)},
    )


@router.get(
    "/requests/{request_id}",
    response_model=RequestStatus,
    responses=ERROR_RESPONSES,
    summary="Status, stage timings and result; ?wait=SECONDS long-polls for a change "
    "(&until_done=true: for the end)",
)
async def get_status(
    request_id: str,
    st: State,
    wait: Wait,
    tenant: Tenant,
    changed_from: Annotated[
        Status | None,
        Query(
            description="with wait: answer as soon as the status differs from this one (pass "
            "the last status you saw, so no change slips between two polls); without it, "
            "the long-poll waits for a change from the status the call finds",
        ),
    ] = None,
    until_done: Annotated[
        bool,
        Query(
            description="with wait: answer only once the request has finished (or the wait "
            "runs out), however many stages it passes meanwhile: one call where following "
            "each change takes one per stage",
        ),
    ] = False,
) -> JSONResponse:
    if wait <= 0:
        return JSONResponse(status_view(await owned_record(request_id, st, tenant)))
    # One read: the wait's first, made once it listens, is the ownership check's too.
    rec = await st.notifier.wait_change(
        request_id,
        changed_from,
        wait,
        until_done=until_done,
        check=lambda found: check_owner(found, request_id, tenant),
    )
    if rec is None:
        raise record_gone(request_id)  # it went during the wait (TTL, an operator)
    return JSONResponse(status_view(rec))


@router.get(
    "/requests/{request_id}/events",
    responses=with_errors(
        {
            200: {
                "description": "Server-Sent Events: one `status` event per status change and, "
                "while the request decodes, `token` events with its tokens and their text as "
                "they are made; the stream closes after the terminal status (which follows "
                "the last token). Resume with `Last-Event-ID` (it covers both kinds).",
                "content": {"text/event-stream": {"schema": SSE_EVENT_SCHEMA}},
            }
        }
    ),
    summary="Server-Sent Events of every status change and of the tokens as they come",
)
async def events(
    request: Request, request_id: str, st: State, rec: OwnedRecord
) -> StreamingResponse:
    last = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if last is not None and not is_stream_id(last):
        raise bad_request("Last-Event-ID must be an id this API sent", rule="events.last_event_id")
    return StreamingResponse(
        event_stream(st, request_id, last or "0"),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


@router.delete(
    "/requests/{request_id}",
    response_model=RequestStatus,
    responses=ERROR_RESPONSES,
    summary="Cancel: status 'cancelled' at once; workers skip the request's work",
)
async def cancel(request_id: str, st: State, rec: OwnedRecord) -> JSONResponse:
    return JSONResponse(status_view(await cancel_owned(st.status, rec, request_id)))
