"""Submitting requests into the pipeline and waiting for their outcome (client side).

Render (in a worker thread) -> ``queued`` status -> fan-out publish. ``wait`` polls the status
record: the submit-and-poll contract the HTTP API exposes too.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from producers.fanout import FanOut, FanoutStats
from producers.render import ImageInput, Renderer
from producers.video import VideoInput
from runtime.settings import Settings
from runtime.status_store import StatusStore
from runtime.tracing import TRACEPARENT, new_traceparent, stage_span, trace_id_of
from schemas.types import TERMINAL_STATUSES, RenderEvent, ResultEvent, SamplingParams


class Submitter:
    """Renders and publishes requests; reads their status records."""

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

    async def submit_rendered(self, ev: RenderEvent) -> FanoutStats:
        """Publish an already rendered request (it gets a W3C ``traceparent`` if it has none)."""
        ev.trace.setdefault(TRACEPARENT, new_traceparent())
        with stage_span("submit", ev.trace, request_id=ev.request_id):
            queued = ResultEvent(
                request_id=ev.request_id,
                stage="api",
                status="queued",
                info={"trace_id": trace_id_of(ev.trace[TRACEPARENT]) or ""},
            )
            # The record's "queued" is written while the fan-out plans (hashes, store lookups);
            # the fan-out waits for it before it records or sends anything.
            recorded = asyncio.ensure_future(self.status.apply(queued))
            try:
                return await self.fanout.publish(ev, after=recorded)
            finally:
                # The planning failed first: "queued" is still recorded (before the caller
                # records the failure), and its own error, if any, is the lesser one.
                await asyncio.wait([recorded])
                if not recorded.cancelled():
                    recorded.exception()

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
        rid = request_id or uuid.uuid4().hex
        ev = await self.renderer.render_async(
            rid,
            prompt=prompt,
            token_ids=token_ids,
            images=images,
            videos=videos,
            sampling=sampling,
            cache_salt=cache_salt,
            deadline_ms=deadline_ms,
        )
        return ev, await self.submit_rendered(ev)

    async def wait(
        self, request_id: str, timeout_s: float = 120.0, poll_s: float = 0.02
    ) -> dict[str, Any]:
        """Poll the status record until it is terminal; TimeoutError after ``timeout_s``.

        A Redis that cannot be read for a while (restarting, frozen) does not end the wait: the
        request is still running, so the poll goes on until the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        delay = poll_s
        rec: dict[str, Any] | None = None
        unreadable: RedisError | None = None
        while True:
            try:
                rec = await self.status.get(request_id)
                unreadable = None
            except RedisError as exc:
                unreadable = exc
            if rec is not None and rec["status"] in TERMINAL_STATUSES:
                return rec
            if loop.time() >= deadline:
                state = rec["status"] if rec else "unknown"
                why = f" (Redis unreadable: {unreadable!r})" if unreadable else ""
                raise TimeoutError(f"request {request_id} still {state} after {timeout_s}s{why}")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)
