"""A checked conversation -> the intake, and waiting for its outcome.

The render (run by the intake, under its render bound, after admission) fetches the allowed
media URLs, writes the prompt with the model's chat template, renders it with the items, and,
when the request named no ``max_tokens``, lets it generate what the context leaves (at most
``EPD_MAX_TOKENS_LIMIT``), as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request

from producers.api.checks import JSON, content_type
from producers.api.data_strings import sniff_image_type
from producers.api.errors import ApiError, answered
from producers.api.media_urls import FetchTotal
from producers.api.openai_compat.inputs import Conversation, Media
from producers.api.openai_compat.views import record_gone_503
from producers.api.state import ApiState
from producers.api.submissions import SubmitHeaders, off_the_loop
from producers.api.videos import sniff_video_type
from producers.intake import Accepted, RenderContext, Submission
from runtime.model import placeholder_ids
from schemas.errors import ValidationError
from schemas.status_record import StatusRecord
from schemas.types import RenderEvent, now_ms


def takes_video(st: ApiState) -> bool:
    """Whether the served family runs video items."""
    return "video" in placeholder_ids(st.info)


@contextlib.asynccontextmanager
async def read_conversation(
    request: Request, st: ApiState, parse: Callable[..., Conversation]
) -> AsyncIterator[Conversation]:
    """The request's JSON body, bounded (:class:`producers.api.bodies.BodyRules`), then
    checked by ``parse`` (``parse_chat`` or ``parse_response``) in a worker thread for a
    large body, with the deployment's limits. The body's bytes stay reserved until the block
    ends: submit inside it (the render holds its media), wait for the outcome after it."""
    content_type(request, JSON)
    async with st.bodies.held(request) as body:
        with answered():
            conv = await off_the_loop(
                len(body),
                parse,
                body,
                st.limits,
                st.settings,
                st.media,
                takes_video(st),
                st.chat.control_tokens,
                slot=st.bodies.parsing,
            )
        del body  # the parse holds what the render needs
        yield conv
        conv.media.clear()  # submitted: the bytes go with the reservation, not the wait


async def _all_fetched(st: ApiState, media: list[Media]) -> list[bytes]:
    """The items' bytes, fetched side by side under one :class:`FetchTotal` for the request;
    the first failure stops the other fetches (their bytes would be thrown away)."""
    total = st.media.total()
    tasks = [asyncio.ensure_future(_fetched(st, m, total)) for m in media]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _fetched(st: ApiState, item: Media, total: FetchTotal) -> bytes:
    """An item's bytes: given, or fetched from its (allowed) URL and sniffed."""
    if item.data is not None:
        return item.data
    s = st.settings
    limit = s.api_max_image_bytes if item.kind == "image" else s.api_max_video_bytes
    data = await st.media.fetch(str(item.url), item.ref, limit, total)
    sniff = sniff_image_type if item.kind == "image" else sniff_video_type
    if not data or sniff(data) is None:
        raise ValidationError(
            "image_url.type",
            f"the {item.kind} at the URL is not a format this server decodes (checked by its "
            "leading bytes)",
            field=item.ref.field,
            item=item.ref.item,
            modality=item.kind,
        )
    return data


def conversation_submission(
    st: ApiState,
    conv: Conversation,
    tenant: str | None,
    headers: SubmitHeaders,
    front: dict[str, Any],
) -> Submission:
    """The intake's :class:`Submission` of a checked conversation."""
    # The render's own list: read_conversation clears the conversation's once the submit
    # returned, and an enqueue outlives a client that went away mid-submit.
    media = list(conv.media)

    async def render(ctx: RenderContext) -> RenderEvent:
        # The fetches count against the render's time too: this render holds a render slot.
        give_up_at = time.monotonic() + st.settings.api_render_timeout_s
        try:
            async with asyncio.timeout(st.settings.api_render_timeout_s):
                data = await _all_fetched(st, media)
        except TimeoutError:
            raise ValidationError(
                "render.timeout",
                "fetching the media URLs ran past the render time limit "
                "(EPD_API_RENDER_TIMEOUT_S); send fewer or smaller inputs, or faster URLs",
            ) from None
        images = [d for m, d in zip(media, data, strict=True) if m.kind == "image"]
        videos = [d for m, d in zip(media, data, strict=True) if m.kind == "video"]
        ids = await asyncio.to_thread(st.chat.token_ids, conv.messages)
        st.limits.check_prompt(None, ids)
        ev = await st.renderer.render_async(
            ctx.request_id,
            timeout_s=max(0.001, give_up_at - time.monotonic()),
            token_ids=ids,
            images=images,
            videos=videos,
            sampling=ctx.sampling,
            cache_salt=ctx.cache_salt,
            deadline_ms=ctx.deadline_ms,
        )
        if not conv.max_tokens_given:
            room = st.limits.context_tokens - len(ev.token_ids)
            ev.sampling = dataclasses.replace(
                ev.sampling, max_tokens=max(1, min(st.limits.max_tokens, room))
            )
        return ev

    return Submission(
        render=render,
        sampling=conv.sampling,
        tenant=tenant,
        cache_salt=conv.cache_salt,
        metadata=conv.metadata,
        front=front,
        traceparent=headers.traceparent,
        idempotency_key=headers.idempotency_key,
        fingerprint=conv.fingerprint,
        decodes_media=bool(media),
        door_checked=True,  # sampling_of and the raw-body count (inputs.py)
    )


def front_of(conv: Conversation, api: str, **more: Any) -> dict[str, Any]:
    """What the record keeps for the OpenAI views (small: no prompt, no media)."""
    return {"api": api, "model": conv.model, "created_s": now_ms() // 1000, **more}


async def submit(
    st: ApiState, request: Request, conv: Conversation, tenant: str | None, front: dict[str, Any]
) -> Accepted:
    """Hand a conversation to the intake (``Accepted``, or the intake's refusals; an error
    of the render names the message part it is in: :meth:`Conversation.name_part`)."""
    sub = conversation_submission(st, conv, tenant, SubmitHeaders.of(request), front)
    try:
        return await st.intake.submit(sub)
    except (ValidationError, ApiError) as exc:  # the render's, the fetch's, the intake's
        conv.name_part(exc)
        raise


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (its connection closed)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def cancel_if_abandoned(st: ApiState, request_id: str, keyed: bool) -> None:
    """The client went away before the answer: cancel the request, as vLLM aborts it, so
    nobody's GPU time goes to an answer no one reads; unless it came with an
    ``Idempotency-Key`` (a retry under the key will want it)."""
    if not keyed:
        st.later(st.status.cancel(request_id, "the client closed the connection"), "abandon")


async def outcome(
    st: ApiState, request: Request, request_id: str, keyed: bool
) -> StatusRecord | None:
    """The request's terminal record, waiting on status notifications (no polling); None when
    the client disconnected first (which cancels the request: :func:`cancel_if_abandoned`).
    A record that went before the request ended raises :func:`record_gone_503` (503)."""
    gone = asyncio.create_task(_disconnected(request))
    try:
        seen: str | None = None
        while True:
            wait = asyncio.create_task(
                st.notifier.wait_change(request_id, seen, st.settings.api_max_wait_s)
            )
            done, _ = await asyncio.wait({wait, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                wait.cancel()
                cancel_if_abandoned(st, request_id, keyed)
                return None
            rec = wait.result()
            if rec is None:
                # Its record went while it ran (TTL, eviction, a Redis restart): no outcome
                # can come this way, and no worker makes the record again.
                raise record_gone_503()
            if rec.terminal:
                return rec
            seen = rec.status
    finally:
        gone.cancel()
        with contextlib.suppress(BaseException):
            await gone
