"""``/v1/responses``: OpenAI's Responses API, its own submit-and-poll (``background``), on the
intake: create, retrieve, cancel."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from frontend.api.cancels import cancel_owned
from frontend.api.deps import State, Tenant
from frontend.api.errors import not_found
from frontend.api.metrics import client_gone
from frontend.api.openai_compat.openapi import (
    RESPONSE_BODY,
    RESPONSE_RESPONSES,
    with_openai_errors,
)
from frontend.api.openai_compat.outcome import outcome
from frontend.api.openai_compat.views import (
    RESPONSE_PREFIX,
    created_response_object,
    response_object,
)
from frontend.api.submit import submit_body
from frontend.api.submit.conversation import Conversation, check_response
from frontend.api.submit.openai import ConversationDoor, front_of
from schemas.status_record import StatusRecord

router = APIRouter(prefix="/v1", tags=["openai"])

RESPONSES_API = "responses"


@router.post(
    "/responses",
    responses=RESPONSE_RESPONSES,
    openapi_extra={"requestBody": RESPONSE_BODY},
    summary="OpenAI responses: background answers queued at once (poll by id), else when done",
)
async def create_response(request: Request, st: State, tenant: Tenant) -> Response:
    done = await submit_body(request, st, tenant, ConversationDoor(st, check_response, _front))
    accepted, conv = done.accepted, done.input
    rid = accepted.request_id
    if conv.background:
        rec = await st.status.get(rid)
        if rec is None:
            raise not_found(RESPONSE_PREFIX + rid, what="response", field="response_id")
        # A retry of the same create (its idempotency key) answers the response as it stands.
        view = response_object(rec) if accepted.duplicate else created_response_object(rec)
        return JSONResponse(view)
    keyed = request.headers.get("idempotency-key") is not None
    rec = await outcome(st, request, rid, keyed)
    if rec is None:
        client_gone(request, "wait")
        return Response(status_code=499)  # the client closed the connection
    return JSONResponse(response_object(rec))


def _front(conv: Conversation) -> dict[str, Any]:
    """What a response's record keeps for its views."""
    s = conv.sampling
    return front_of(
        conv,
        RESPONSES_API,
        background=conv.background,
        max_tokens=s.max_tokens if conv.max_tokens_given else None,
        temperature=s.temperature,
        top_p=s.top_p,
    )


async def owned_response(response_id: str, st: State, tenant: Tenant) -> StatusRecord:
    """The caller's response record. Another tenant's response, a request of another API, or
    an unknown id are all "not found": ids reveal nothing."""
    rid = response_id.removeprefix(RESPONSE_PREFIX)
    rec = None
    if response_id.startswith(RESPONSE_PREFIX) and rid:
        rec = await st.status.get(rid)
    if rec is None or rec.tenant != tenant or rec.front.get("api") != RESPONSES_API:
        raise not_found(response_id, what="response", field="response_id")
    return rec


OwnedResponse = Annotated[StatusRecord, Depends(owned_response)]


@router.get(
    "/responses/{response_id}",
    responses=with_openai_errors({200: {"model": RESPONSE_RESPONSES[200]["model"]}}),
    summary="A response: queued, in_progress, completed (with its output), failed, cancelled",
)
async def get_response(response_id: str, rec: OwnedResponse) -> JSONResponse:
    return JSONResponse(response_object(rec))


@router.post(
    "/responses/{response_id}/cancel",
    responses=with_openai_errors({200: {"model": RESPONSE_RESPONSES[200]["model"]}}),
    summary="Cancel a response: cancelled at once; the workers skip its remaining work",
)
async def cancel_response(response_id: str, st: State, rec: OwnedResponse) -> JSONResponse:
    return JSONResponse(response_object(await cancel_owned(st.status, rec, response_id)))
