"""Submitting requests into the pipeline from this process, and waiting for their outcome.

The ``Submitter`` is a front of the :class:`producers.intake.Intake`, as the HTTP API is: the
same status record, render bound and failure recording (no admission: an in-process caller is
trusted). ``wait`` polls the status record: the submit-and-poll contract the HTTP API exposes
too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from media.video import VideoInput
from producers.fanout import FanOut, FanoutStats, build_fanout
from producers.intake import Intake, RenderContext, Submission
from producers.render import ImageInput, Renderer
from runtime.publisher import Publisher
from runtime.settings import Settings
from runtime.status import StatusStore
from schemas.status_record import StatusRecord
from schemas.types import RenderEvent, SamplingParams

if TYPE_CHECKING:
    from runtime.model import RenderInfo
    from runtime.stores.base import EmbeddingStore


class Submitter:
    """Renders and publishes requests through an :class:`Intake`; reads their status records."""

    def __init__(
        self,
        settings: Settings,
        renderer: Renderer,
        fanout: FanOut,
        status: StatusStore,
    ) -> None:
        self.settings = settings
        self.renderer = renderer
        self.fanout = fanout
        self.status = status
        self.intake = Intake(fanout, status, span="submit")

    @classmethod
    def for_pipeline(
        cls,
        settings: Settings,
        info: RenderInfo,
        *,
        store: EmbeddingStore,
        publisher: Publisher,
        status: StatusStore,
    ) -> Submitter:
        """The submitter of a pipeline (renderer and fan-out from ``settings``)."""
        fanout = build_fanout(settings, store, info, publisher, record=status.apply)
        return cls(settings, Renderer.for_settings(info, settings), fanout, status)

    async def submit_rendered(self, ev: RenderEvent) -> FanoutStats:
        """Publish an already rendered request (it gets a W3C ``traceparent`` if it has none)."""
        accepted = await self.intake.submit(Submission.rendered(ev))
        assert accepted.stats is not None
        return accepted.stats

    async def submit(
        self,
        *,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        images: Sequence[ImageInput] = (),
        videos: Sequence[VideoInput] = (),
        sampling: SamplingParams | None = None,
        cache_salt: str | None = None,
        deadline_ms: int | None = None,
        request_id: str | None = None,
    ) -> tuple[RenderEvent, FanoutStats]:
        """Render and publish one request; returns the rendered event and fan-out stats."""

        async def render(ctx: RenderContext) -> RenderEvent:
            return await self.renderer.render_async(
                ctx.request_id,
                prompt=prompt,
                token_ids=token_ids,
                images=images,
                videos=videos,
                sampling=ctx.sampling,
                cache_salt=ctx.cache_salt,
                deadline_ms=ctx.deadline_ms,
            )

        accepted = await self.intake.submit(
            Submission(
                render=render,
                sampling=sampling or SamplingParams(),
                cache_salt=cache_salt,
                deadline_ms=deadline_ms,
                request_id=request_id,
                decodes_media=bool(images or videos),
            )
        )
        assert accepted.event is not None and accepted.stats is not None
        return accepted.event, accepted.stats

    async def wait(
        self, request_id: str, timeout_s: float = 120.0, poll_s: float = 0.02
    ) -> StatusRecord:
        """Poll the status record until it is terminal; TimeoutError after ``timeout_s``.

        A Redis that cannot be read for a while (restarting, frozen) does not end the wait: the
        request is still running, so the poll goes on until the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = poll_s
        rec: StatusRecord | None = None
        unreadable: RedisError | None = None
        while True:
            try:
                rec = await self.status.get(request_id)
                unreadable = None
            except RedisError as exc:
                unreadable = exc
            if rec is not None and rec.terminal:
                return rec
            if loop.time() >= deadline:
                state = rec.status if rec else "unknown"
                why = f" (Redis unreadable: {unreadable!r})" if unreadable else ""
                raise TimeoutError(f"request {request_id} still {state} after {timeout_s}s{why}")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)
