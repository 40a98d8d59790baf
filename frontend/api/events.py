"""Server-Sent Events of a request: its status changes and, while it decodes, its tokens
(``token`` events), from :func:`frontend.api.follow.follow`; ``Last-Event-ID`` resumes across
both kinds. A stream whose request's record went before the request ended (its TTL, a Redis
restart) ends with an ``error`` event (the API's error body: 404, rule ``status-gone``), so that
it is never read as one that ended normally."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from frontend.api.errors import ApiError
from frontend.api.follow import Position, RecordGone, StatusChange, follow
from frontend.api.state import ApiState
from runtime.token_stream import TokenChunk
from schemas.statuses import STATUSES

# One Server-Sent Event of /events (OpenAPI 3.1: the media type's schema describes one event;
# its data is JSON).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": ["status", "token", "error"]},
        "id": {
            "type": "string",
            "description": "resume with Last-Event-ID (it covers both status and token events)",
        },
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "oneOf": [
                    {
                        "title": "status event",
                        "type": "object",
                        "required": ["request_id", "status", "stage", "at_ms"],
                        "properties": {
                            "request_id": {"type": "string"},
                            "status": {"type": "string", "enum": list(STATUSES)},
                            "stage": {"type": "string"},
                            "at_ms": {"type": "integer"},
                            "token_ids": {
                                "type": ["array", "null"],
                                "items": {"type": "integer"},
                            },
                            "text": {"type": ["string", "null"]},
                            "error": {"type": ["object", "null"]},
                        },
                    },
                    {
                        "title": "token event",
                        "type": "object",
                        "required": ["request_id", "token_ids", "text", "tokens_total"],
                        "properties": {
                            "request_id": {"type": "string"},
                            "token_ids": {"type": "array", "items": {"type": "integer"}},
                            "text": {
                                "type": "string",
                                "description": "the tokens' text (never half a character)",
                            },
                            "tokens_total": {"type": "integer"},
                            "finish_reason": {"type": ["string", "null"]},
                        },
                    },
                    {
                        "title": "error event (the record went before the request ended)",
                        "type": "object",
                        "required": ["status", "error"],
                        "properties": {
                            "status": {"type": "integer"},
                            "error": {"type": "object"},
                        },
                    },
                ]
            },
        },
    },
}


def is_stream_id(text: str) -> bool:
    """True for an event id this API sends (see :class:`frontend.api.follow.Position`)."""
    return Position.parse(text) is not None


def _frame(kind: str, at: Position, data: dict[str, Any]) -> bytes:
    return f"id: {at.event_id()}\nevent: {kind}\ndata: {json.dumps(data)}\n\n".encode()


def record_gone(request_id: str) -> ApiError:
    """What an event stream ends with, and a read or cancel by id answers, when the
    request's record went before it ended (404: the id names nothing any more; the OpenAI
    routes' awaited answers say it as 503, ``openai_compat.views.record_gone_503``)."""
    return ApiError(
        404,
        "not_found",
        f"the status record of {request_id} is gone (expired, or lost with a Redis restart) "
        "before the request ended; its outcome, if any, is on the results topic",
        rule="status-gone",
    )


async def event_stream(st: ApiState, request_id: str, last: str) -> AsyncIterator[bytes]:
    """SSE frames: what happened after ``last`` (an event id), then each status change and
    token chunk as it comes; ends after the terminal status, or with an ``error`` event when
    the record is gone."""
    async for item, at in follow(st, request_id, Position.parse(last) or Position()):
        if item is None:
            yield b": keep-alive\n\n"
        elif isinstance(item, StatusChange):
            yield _frame("status", at, item.data)
        elif isinstance(item, TokenChunk) and (item.token_ids or item.text or item.finish_reason):
            data: dict[str, Any] = {
                "request_id": request_id,
                "token_ids": item.token_ids,
                "text": item.text,
                "tokens_total": item.tokens_total,
            }
            if item.finish_reason:
                data["finish_reason"] = item.finish_reason
            yield _frame("token", at, data)
        elif isinstance(item, RecordGone):
            body = {"status": 404, **record_gone(request_id).body()}
            yield f"event: error\ndata: {json.dumps(body)}\n\n".encode()
