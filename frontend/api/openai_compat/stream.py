"""A streamed chat completion: ``chat.completion.chunk`` server-sent events as the tokens come,
ending with ``data: [DONE]``.

The first chunk carries the assistant role; each token chunk of the request's stream
(:func:`frontend.api.follow.follow`) becomes a content chunk; the last names the finish
reason, then (``stream_options.include_usage``) a chunk with the usage and no choices; with
``stream_options.continuous_usage_stats`` (vLLM's) every chunk also carries the usage so far
(the prompt's tokens, those generated up to it, their total), as vLLM writes it. The
status record's final text is the reference: should a token-stream write have been lost, what
the chunks missed is sent before the finish. A request that ends other than completed ends the
stream with an error event in OpenAI's shape, and so does one whose status record went before
it ended (``status-gone``). A client that goes away cancels the request
(unless it came with an ``Idempotency-Key``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from frontend.api.errors import ApiError
from frontend.api.follow import RecordGone, StatusChange, follow
from frontend.api.openai_compat.errors import openai_body
from frontend.api.openai_compat.outcome import cancel_if_abandoned
from frontend.api.openai_compat.views import (
    CHAT_PREFIX,
    finish_reason,
    not_completed,
    record_gone_503,
    usage,
)
from frontend.api.state import ApiState
from runtime.token_stream import TokenChunk
from schemas.status_record import StatusRecord

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
        self.prompt_tokens: int | None = None
        """Set: every chunk carries the usage so far (``continuous_usage_stats``)."""

    def chunk(self, delta: dict[str, Any], finish: str | None = None, *, made: int = 0) -> bytes:
        """A chunk of one choice; ``made``: the tokens generated so far."""
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        out: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.prompt_tokens is not None:
            out["usage"] = {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": made,
                "total_tokens": self.prompt_tokens + made,
            }
        return _event(out)

    def usage(self, use: dict[str, int]) -> bytes:
        return _event({**self.base, "choices": [], "usage": use})


async def _prompt_tokens(st: ApiState, request_id: str, known: int | None) -> int:
    """The prompt's length: as the route rendered it, else (a duplicate under an
    ``Idempotency-Key``) as the record keeps it."""
    if known is not None:
        return known
    rec = await st.status.get(request_id)
    return 0 if rec is None else rec.prompt_tokens


def _ending(
    w: ChunkWriter,
    rec: StatusRecord | None,
    streamed: str,
    include_usage: bool,
    name_part: Callable[[ApiError], None] | None,
) -> list[bytes]:
    """The events after the terminal status: the text not streamed yet, the finish and the
    usage of a completed request; else the error it ended with (the stream then ends)."""
    if rec is None:  # it went right after its terminal status
        return [_event(openai_body(record_gone_503()))]
    if rec.status != "completed":
        err = not_completed(rec)
        if name_part is not None and rec.status == "rejected":
            name_part(err)
        return [_event(openai_body(err))]
    text, made = rec.text or "", len(rec.token_ids or [])
    out = []
    if text.startswith(streamed) and len(text) > len(streamed):
        out.append(w.chunk({"content": text[len(streamed) :]}, made=made))
    out.append(w.chunk({}, finish_reason(rec), made=made))
    if include_usage:
        out.append(w.usage(usage(rec)))
    return out


async def chat_chunks(
    st: ApiState,
    request_id: str,
    *,
    model: str,
    created_s: int,
    include_usage: bool,
    keyed: bool,
    continuous_usage: bool = False,
    prompt_tokens: int | None = None,
    name_part: Callable[[ApiError], None] | None = None,
    gone: Callable[[], None] | None = None,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed chat completion (see the module docstring).
    ``continuous_usage``: every chunk carries the usage so far (``prompt_tokens``: the
    prompt's length, read from the record when not given). ``name_part`` points a worker's
    refusal at the message part it is about; ``gone`` is called when the client leaves
    before the end."""
    w = ChunkWriter(request_id, model, created_s)
    sent: list[str] = []
    ended = False
    try:
        if continuous_usage:
            w.prompt_tokens = await _prompt_tokens(st, request_id, prompt_tokens)
        yield w.chunk({"role": "assistant", "content": ""})
        async for item, _ in follow(st, request_id):
            if item is None:
                yield b": keep-alive\n\n"
            elif isinstance(item, TokenChunk):
                if item.text:
                    sent.append(item.text)
                    yield w.chunk({"content": item.text}, made=item.tokens_total)
            elif isinstance(item, StatusChange) and item.terminal:
                ended = True
                rec = await st.status.get(request_id)
                for event in _ending(w, rec, "".join(sent), include_usage, name_part):
                    yield event
                if rec is None or rec.status != "completed":
                    break
            elif isinstance(item, RecordGone):
                # No outcome will come this way, and a stream that just stopped would read as
                # a whole answer.
                yield _event(openai_body(record_gone_503()))
        ended = True
        yield DONE
    finally:
        if not ended:  # the client went away mid-stream (the body's task was cancelled)
            cancel_if_abandoned(st, request_id, keyed)
            if gone is not None:
                gone()
