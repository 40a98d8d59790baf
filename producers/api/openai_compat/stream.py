"""A streamed chat completion: ``chat.completion.chunk`` server-sent events as the tokens come,
ending with ``data: [DONE]``.

The first chunk carries the assistant role; each token chunk of the request's stream
(:func:`producers.api.follow.follow`) becomes a content chunk; the last names the finish
reason, then (``stream_options.include_usage``) a chunk with the usage and no choices. The
status record's final text is the reference: should a token-stream write have been lost, what
the chunks missed is sent before the finish. A request that ends other than completed ends the
stream with an error event in OpenAI's shape, and so does one whose status record went before
it ended (``status-gone``). A client that goes away cancels the request
(unless it came with an ``Idempotency-Key``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from producers.api.follow import RecordGone, StatusChange, follow
from producers.api.openai_compat.errors import openai_body
from producers.api.openai_compat.submit import cancel_if_abandoned
from producers.api.openai_compat.views import (
    CHAT_PREFIX,
    RECORD_GONE,
    finish_reason,
    not_completed,
    usage,
)
from producers.api.state import ApiState
from runtime.token_stream import TokenChunk

DONE = b"data: [DONE]\n\n"


def _event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class ChunkWriter:
    """The chunks of one streamed completion."""

    def __init__(self, request_id: str, model: str, created_s: int) -> None:
        self.base = {
            "id": CHAT_PREFIX + request_id,
            "object": "chat.completion.chunk",
            "created": created_s,
            "model": model,
        }

    def chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return _event({**self.base, "choices": [choice]})

    def usage(self, use: dict[str, int]) -> bytes:
        return _event({**self.base, "choices": [], "usage": use})


async def chat_chunks(
    st: ApiState,
    request_id: str,
    *,
    model: str,
    created_s: int,
    include_usage: bool,
    keyed: bool,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat completion (see the module docstring)."""
    w = ChunkWriter(request_id, model, created_s)
    sent: list[str] = []
    ended = False
    try:
        yield w.chunk({"role": "assistant", "content": ""})
        async for item, _ in follow(st, request_id):
            if item is None:
                yield b": keep-alive\n\n"
            elif isinstance(item, TokenChunk):
                if item.text:
                    sent.append(item.text)
                    yield w.chunk({"content": item.text})
            elif isinstance(item, StatusChange) and item.terminal:
                ended = True
                rec = await st.status.get(request_id)
                if rec is None:  # it went right after its terminal status
                    yield _event(openai_body(RECORD_GONE))
                    break
                if rec.status != "completed":
                    yield _event(openai_body(not_completed(rec)))
                    break
                text, streamed = rec.text or "", "".join(sent)
                if text.startswith(streamed) and len(text) > len(streamed):
                    yield w.chunk({"content": text[len(streamed) :]})
                yield w.chunk({}, finish_reason(rec))
                if include_usage:
                    yield w.usage(usage(rec))
            elif isinstance(item, RecordGone):
                # No outcome will come this way, and a stream that just stopped would read as
                # a whole answer.
                yield _event(openai_body(RECORD_GONE))
        ended = True
        yield DONE
    finally:
        if not ended:  # the client went away mid-stream (the body's task was cancelled)
            cancel_if_abandoned(st, request_id, keyed)
