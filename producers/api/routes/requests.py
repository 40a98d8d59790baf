"""``/v1/requests``: submit (render + fan-out), poll and long-poll, events, cancel."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from producers.api.bodies import SubmitInput, parse_json_submit, parse_multipart_submit
from producers.api.checks import JSON, MULTIPART, content_type, refuse_finished
from producers.api.deps import OwnedRecord, State, Tenant, Wait
from producers.api.errors import bad_request
from producers.api.events import SSE_EVENT_SCHEMA, event_stream, is_stream_id, record_gone
from producers.api.models import ERROR_RESPONSES, Accepted, RequestStatus
from producers.api.openapi import IDEMPOTENCY_PARAM, SUBMIT_BODY, SUBMIT_RESPONSES, with_errors
from producers.api.state import ApiState
from producers.api.submissions import SubmitHeaders, accepted_response, off_the_loop
from producers.api.views import status_view
from producers.intake import RenderContext, Submission
from schemas.statuses import Status
from schemas.types import RenderEvent, now_ms

router = APIRouter(prefix="/v1", tags=["requests"])


@router.post(
    "/requests",
    status_code=202,
    response_model=Accepted,
    responses=SUBMIT_RESPONSES,
    openapi_extra={"requestBody": SUBMIT_BODY, "parameters": [IDEMPOTENCY_PARAM]},
    summary="Submit a request (render + enqueue); answers 202 without waiting for a GPU",
)
async def submit(request: Request, st: State, tenant: Tenant) -> JSONResponse:
    ctype = content_type(request, JSON, MULTIPART)
    # The body's bytes stay reserved through the render: its images are held until then.
    async with st.bodies.held(request) as body:
        if ctype == JSON:
            inp = await off_the_loop(
                len(body), parse_json_submit, body, st.limits, st.settings, slot=st.bodies.parsing
            )
        else:
            inp = await parse_multipart_submit(request, body, st.limits, st.settings)
        del body  # the parse holds what the render needs
        sub = native_submission(st, inp, tenant, SubmitHeaders.of(request))
        accepted = await st.intake.submit(sub)
    return accepted_response(accepted)


def native_submission(
    st: ApiState, inp: SubmitInput, tenant: str | None, headers: SubmitHeaders
) -> Submission:
    """A parsed ``/v1/requests`` body as the intake's :class:`Submission`."""

    async def render(ctx: RenderContext) -> RenderEvent:
        return await st.renderer.render_async(
            ctx.request_id,
            timeout_s=st.settings.api_render_timeout_s,
            prompt=inp.prompt,
            token_ids=inp.token_ids,
            images=inp.images,
            videos=inp.videos,
            sampling=ctx.sampling,
            cache_salt=ctx.cache_salt,
            deadline_ms=ctx.deadline_ms,
        )

    deadline = None if inp.deadline_s is None else now_ms() + int(inp.deadline_s * 1000)
    return Submission(
        render=render,
        sampling=inp.sampling(),
        tenant=tenant,
        cache_salt=inp.cache_salt,
        deadline_ms=deadline,
        metadata=inp.metadata,
        traceparent=headers.traceparent,
        idempotency_key=headers.idempotency_key,
        fingerprint=inp.fingerprint(),
        decodes_media=bool(inp.images or inp.videos),
        door_checked=True,  # the body's parse (bodies.py) checked sampling and counts
    )


@router.get(
    "/requests/{request_id}",
    response_model=RequestStatus,
    responses=ERROR_RESPONSES,
    summary="Status, stage timings and result; ?wait=SECONDS long-polls for a change",
)
async def get_status(
    request_id: str,
    st: State,
    wait: Wait,
    rec: OwnedRecord,
    changed_from: Annotated[
        Status | None,
        Query(
            description="with wait: answer as soon as the status differs from this one (pass "
            "the last status you saw, so no change slips between two polls); without it, "
            "the long-poll waits for a change from the status the call finds",
        ),
    ] = None,
) -> JSONResponse:
    if wait > 0 and not rec.terminal:
        since = changed_from or rec.status
        changed = await st.notifier.wait_change(request_id, since, wait)
        if changed is None:
            raise record_gone(request_id)  # it went during the wait (TTL, an operator)
        rec = changed
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
    refuse_finished(rec)
    await st.status.cancel(request_id)
    after = await st.status.get(request_id)
    if after is None:
        raise record_gone(request_id)  # it went between the read and the cancel
    refuse_finished(after)  # it finished between the read and the cancel
    rec = after
    return JSONResponse(status_view(rec))
