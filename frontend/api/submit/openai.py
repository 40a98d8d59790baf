"""The OpenAI-compatible routes' door (``/v1/chat/completions``, ``/v1/responses``) on the one
path (:func:`frontend.api.submit.submit_body`): a checked conversation -> the intake.

The render (run by the intake, under its render bound, after admission) fetches the allowed
media URLs, writes the prompt with the model's chat template, renders it with the items, and,
when the request named no ``max_tokens``, lets it generate what the context leaves (at most
``EPD_MAX_TOKENS_LIMIT``), as vLLM does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from frontend.api.errors import ApiError
from frontend.api.submit import SubmitHeaders
from frontend.api.submit.conversation import (
    Conversation,
    Deployment,
    Media,
    json_object,
    with_media,
)
from frontend.api.submit.media import sniff_image_type, sniff_video_type
from frontend.api.submit.media_urls import FetchTotal
from frontend.api.submit.reading import JSON, off_the_loop
from producers.intake import RenderContext, Submission
from runtime.model import placeholder_ids
from schemas.errors import ValidationError
from schemas.types import RenderEvent, now_ms

if TYPE_CHECKING:
    from frontend.api.state import ApiState

Check = Callable[[dict[str, Any], Deployment], Conversation]
"""``check_chat`` or ``check_response``."""


def takes_video(st: ApiState) -> bool:
    """Whether the served family runs video items."""
    return "video" in placeholder_ids(st.info)


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
    # The render takes the bytes: the conversation keeps only where each item is (to name
    # errors), so waiting for the outcome holds none, and an enqueue outlives a client that
    # went away mid-submit.
    media = list(conv.media)
    conv.media = [Media(m.kind, m.ref) for m in media]

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
        door_checked=True,  # check_chat / check_response: sampling and counts
    )


def front_of(conv: Conversation, api: str, **more: Any) -> dict[str, Any]:
    """What the record keeps for the OpenAI views (small: no prompt, no media)."""
    return {"api": api, "model": conv.model, "created_s": now_ms() // 1000, **more}


@dataclass(frozen=True, slots=True)
class ConversationDoor:
    """An OpenAI route's phases: ``check`` is ``check_chat`` or ``check_response``, ``front``
    what the record keeps for the route's views (:func:`front_of`)."""

    st: ApiState
    checker: Check
    front: Callable[[Conversation], dict[str, Any]]
    accepts: tuple[str, ...] = (JSON,)

    async def parse(self, request: Request, ctype: str, body: bytes) -> dict[str, Any]:
        st = self.st
        return await off_the_loop(len(body), json_object, body, st.limits, slot=st.bodies.parsing)

    def work_bytes(self, parsed: dict[str, Any], body_bytes: int) -> int:
        """The body's bytes: a JSON body, decoded whole."""
        return body_bytes

    def check(self, obj: dict[str, Any]) -> Conversation:
        st = self.st
        d = Deployment(st.limits, st.settings, st.media, takes_video(st), st.chat.control_tokens)
        return self.checker(obj, d)

    def media(self, conv: Conversation) -> Conversation:
        return with_media(conv, self.st.settings)

    def submission(
        self, conv: Conversation, tenant: str | None, headers: SubmitHeaders
    ) -> Submission:
        conv.front = self.front(conv)
        return conversation_submission(self.st, conv, tenant, headers, conv.front)

    def blame(self, conv: Conversation, exc: ValidationError | ApiError) -> None:
        """An error of the render names the message part it is in
        (:meth:`Conversation.name_part`)."""
        conv.name_part(exc)
