"""Waiting for an OpenAI request's outcome (its submission is :mod:`frontend.api.submit.openai`'s):
on status notifications, cancelling the request when its client goes away first."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request

from frontend.api.openai_compat.views import record_gone_503
from frontend.api.state import ApiState
from schemas.status_record import StatusRecord


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
                st.notifier.wait_change(
                    request_id, seen, st.settings.api_max_wait_s, until_done=True
                )
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
