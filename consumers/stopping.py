"""What a stopping consume loop does to work that waits: it abandons it.

A record whose retry (or dead-letter send) is waiting out a backoff when the loop stops is given
up, not finished: :class:`Abandoned` unwinds it, and its offset is never committed, so the record
is delivered again after the restart.
"""

from __future__ import annotations

import asyncio
import contextlib

__all__ = ["Abandoned", "sleep_unless_stopping"]


class Abandoned(Exception):
    """A record's work was dropped (the loop is stopping, or its transaction is unusable): leave
    the offset uncommitted."""


async def sleep_unless_stopping(stop: asyncio.Event, delay_s: float) -> None:
    """Back off ``delay_s``; raise :class:`Abandoned` if ``stop`` is set before or meanwhile."""
    if stop.is_set():
        raise Abandoned
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), delay_s)
    if stop.is_set():
        raise Abandoned
