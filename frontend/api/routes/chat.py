"""``/v1/chat/completions``: OpenAI's chat completions, plain or streamed, on the intake."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from frontend.api.deps import State, Tenant
from frontend.api.metrics import client_gone
from frontend.api.openai_compat.openapi import CHAT_BODY, CHAT_RESPONSES
from frontend.api.openai_compat.outcome import outcome
from frontend.api.openai_compat.stream import chat_chunks
from frontend.api.openai_compat.views import chat_completion, not_completed
from frontend.api.submit import submit_body
from frontend.api.submit.conversation import Conversation, check_chat
from frontend.api.submit.openai import ConversationDoor, front_of

router = APIRouter(prefix="/v1", tags=["openai"])

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def chat_front(conv: Conversation) -> dict[str, Any]:
    """What a chat completion's record keeps for its views."""
    return front_of(conv, "chat.completions", max_tokens=conv.sampling.max_tokens)


@router.post(
    "/chat/completions",
    responses=CHAT_RESPONSES,
    openapi_extra={"requestBody": CHAT_BODY},
    summary="OpenAI chat completions: text, image_url and video_url parts; stream as SSE",
)
async def chat_completions(request: Request, st: State, tenant: Tenant) -> Response:
    door = ConversationDoor(st, check_chat, chat_front)
    done = await submit_body(request, st, tenant, door)
    accepted, conv = done.accepted, done.input
    keyed = request.headers.get("idempotency-key") is not None
    if conv.stream:
        return StreamingResponse(
            chat_chunks(
                st,
                accepted.request_id,
                model=conv.model,
                created_s=conv.front["created_s"],
                include_usage=conv.include_usage,
                keyed=keyed,
                continuous_usage=conv.continuous_usage,
                prompt_tokens=None if accepted.event is None else len(accepted.event.token_ids),
                name_part=conv.name_part,
                gone=lambda: client_gone(request, "stream"),
            ),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    rec = await outcome(st, request, accepted.request_id, keyed)
    if rec is None:
        client_gone(request, "wait")
        return Response(status_code=499)  # the client closed the connection; nobody reads this
    if rec.status != "completed":
        err = not_completed(rec)
        if rec.status == "rejected":  # a worker's refusal names its item, not the part
            conv.name_part(err)
        raise err
    return JSONResponse(chat_completion(rec))
