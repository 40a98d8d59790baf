"""Server-Sent Events of a request's status changes: history from the Redis stream, then
each change as the notifier announces it; ``Last-Event-ID`` resumes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from producers.api.state import ApiState
from schemas.types import STATUSES, TERMINAL_STATUSES

# One Server-Sent Event of /events (OpenAPI 3.1: the media type's schema describes one event;
# its data is JSON).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["event", "data"],
    "properties": {
        "event": {"type": "string", "enum": ["status"]},
        "id": {"type": "string", "description": "resume with Last-Event-ID"},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "type": "object",
                "required": ["request_id", "status", "stage", "at_ms"],
                "properties": {
                    "request_id": {"type": "string"},
                    "status": {"type": "string", "enum": list(STATUSES)},
                    "stage": {"type": "string"},
                    "at_ms": {"type": "integer"},
                    "token_ids": {"type": ["array", "null"], "items": {"type": "integer"}},
                    "text": {"type": ["string", "null"]},
                    "error": {"type": ["object", "null"]},
                },
            },
        },
    },
}
SSE_KEEPALIVE_S = 15.0


def is_stream_id(text: str) -> bool:
    """True for a Redis stream id (``MS-SEQ``): what this API sends as an event id."""
    ms, sep, seq = text.partition("-")
    return ms.isdigit() and (not sep or seq.isdigit()) and len(text) < 64


async def event_stream(st: ApiState, request_id: str, last: str) -> AsyncIterator[bytes]:
    """SSE frames: history after ``last``, then each change as it is announced; ends after
    the terminal status (or when the record is gone)."""
    async with st.notifier.watch(request_id) as changed:
        while True:
            changed.clear()
            rows = await st.status.events(request_id, last)
            for sid, data in rows:
                last = sid
                yield (f"id: {sid}\nevent: status\ndata: {json.dumps(data)}\n\n").encode()
                if data.get("status") in TERMINAL_STATUSES:
                    return
            if not rows:
                rec = await st.status.get(request_id)
                if rec is None or rec.terminal:
                    return  # resumed after the terminal event, or expired
            try:
                await asyncio.wait_for(changed.wait(), SSE_KEEPALIVE_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
