"""Following one request as it runs: its status changes and its tokens, as one ordered feed.

Two Redis streams describe a running request: its status changes (``StatusStore.events``) and
its tokens (``runtime.token_stream``). A reader wants both in order, and must not hang on the
token stream of a request that never decodes (refused, expired or cancelled before it did: it
has no token stream at all). :func:`follow` reads both, waits for whichever is written next
(the status notifier and the token notifications, never a sleep loop), and ends with the
terminal status, after the tokens that came before it: a worker ends its token stream before
it writes the terminal status, so every token is out by then (a client's cancel is the
exception: the record turns ``cancelled`` at once, and the tokens made before the workers
stopped are those already in the stream). Should the request's record go before that (its
TTL, a Redis restart), the feed ends with :class:`RecordGone` instead, so that no reader takes
the silence for an ending.

The feed resumes from a :class:`Position` (the last status and token entry seen), so the
native SSE ``Last-Event-ID`` covers both kinds of event.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from frontend.api.state import ApiState
from runtime.redis.stream_ids import entry_order
from runtime.status.store import change_data
from runtime.token_stream import TokenChunk
from schemas.statuses import TERMINAL_STATUSES

IDLE_S = 15.0
"""Longest the feed stays silent: it yields None then (an SSE keep-alive)."""


@dataclass(frozen=True, slots=True)
class Position:
    """How far a reader has read: the last status and token stream entries (``"0"``: none)."""

    status: str = "0"
    tokens: str = "0"

    def event_id(self) -> str:
        """The SSE event id naming this position: ``STATUS_ID`` or ``STATUS_ID_TOKEN_ID``."""
        return self.status if self.tokens == "0" else f"{self.status}_{self.tokens}"

    @classmethod
    def parse(cls, text: str) -> Position | None:
        """The position an event id names (one :meth:`event_id` wrote), or None."""
        status, sep, tokens = text.partition("_")
        if not _stream_id(status) or (sep and not _stream_id(tokens)):
            return None
        return cls(status, tokens or "0")


_STREAM_ID = re.compile(r"([0-9]{1,20})(?:-([0-9]{1,20}))?")
"""``MS-SEQ`` or ``MS``, ASCII digits only (``str.isdigit`` also takes ``²`` and ``٣``)."""
_ID_MAX = 2**64 - 1
"""Redis stream ids are two unsigned 64-bit numbers."""


def _stream_id(text: str) -> bool:
    """An id Redis takes as the exclusive start of a read: two 64-bit numbers, not the
    largest id of all (nothing can follow it, and Redis refuses to read after it)."""
    m = _STREAM_ID.fullmatch(text)
    if m is None:
        return False
    ms, seq = int(m[1]), int(m[2] or 0)
    return ms <= _ID_MAX and seq <= _ID_MAX and (ms, seq) != (_ID_MAX, _ID_MAX)


@dataclass(frozen=True, slots=True)
class StatusChange:
    """One entry of the request's status stream."""

    id: str
    data: dict[str, Any]

    @property
    def terminal(self) -> bool:
        return self.data.get("status") in TERMINAL_STATUSES


@dataclass(frozen=True, slots=True)
class RecordGone:
    """The last item of a feed whose request's record went before the request ended."""


Item = StatusChange | TokenChunk | RecordGone | None
"""What :func:`follow` yields (None: nothing happened for ``IDLE_S``)."""


@dataclass(slots=True)
class Follower:
    """The state of one :func:`follow`: where it is, and what the last wait brought."""

    st: ApiState
    request_id: str
    at: Position

    async def wait(self, changed: asyncio.Event, idle_s: float) -> tuple[list[TokenChunk], bool]:
        """Until a token is written or the status changes (or ``idle_s`` passes): the tokens
        written, and whether the status changed."""
        if changed.is_set():
            return [], True
        tokens = asyncio.create_task(self.st.tokens.wait(self.request_id, self.at.tokens, idle_s))
        status = asyncio.create_task(changed.wait())
        try:
            done, _ = await asyncio.wait(
                {tokens, status}, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for task in (tokens, status):
                if not task.done():
                    task.cancel()
            for task in (tokens, status):
                with contextlib.suppress(BaseException):
                    await task
        got = tokens.result() if tokens in done and tokens.exception() is None else []
        return got, status in done or changed.is_set()


def _in_order(
    changes: list[StatusChange], chunks: list[TokenChunk]
) -> list[StatusChange | TokenChunk]:
    """Status changes and token chunks read together, in the order they were written: the two
    streams' ids are one order without ties (``runtime.redis.stream_ids``), so a live reader
    and a replay give every event in the same place, with the same id."""
    tagged = [(entry_order(c.id), c) for c in changes] + [(entry_order(c.id), c) for c in chunks]
    return [item for _, item in sorted(tagged, key=lambda t: t[0])]


async def _ended(st: ApiState, request_id: str, at: Position) -> RecordGone | bool:
    """Whether a read that found no new status change has nothing more to wait for:
    :class:`RecordGone` when the record is gone; True when it is terminal with no status
    change after ``at`` (a reader resumed past the terminal status, whatever token position
    it gave: the worker wrote every token before the terminal status, so none can follow).
    A terminal change written since the read is read next, not skipped."""
    rec = await st.status.get(request_id)
    if rec is None:
        return RecordGone()
    if not rec.terminal:
        return False
    return not await st.status.events(request_id, at.status)


async def follow(
    st: ApiState, request_id: str, at: Position | None = None, idle_s: float = IDLE_S
) -> AsyncIterator[tuple[Item, Position]]:
    """Each status change and token chunk after ``at``, with the position after it, until the
    terminal status (yielded last) or until the record is gone (:class:`RecordGone`, last).

    Each round reads both streams at one instant (:meth:`TokenStreams.read_both`) and yields
    what it found in id order, which is write order: a live reader gives every event where a
    replay from any position gives it, with the same id."""
    f = Follower(st, request_id, at or Position())
    async with st.notifier.watch(request_id) as changed:
        look_for_end = True  # the request may have ended (or gone) before the first read
        while True:
            changed.clear()
            both = await st.tokens.read_both(request_id, f.at.status, f.at.tokens)
            pending, terminal = _split(both.changes)
            for item in _in_order(pending, both.chunks):
                if isinstance(item, StatusChange):
                    f.at = replace(f.at, status=item.id)
                else:
                    f.at = replace(f.at, tokens=item.id)
                yield item, f.at
            last: StatusChange | RecordGone | bool | None = terminal
            if last is None and look_for_end and not both.changes and not both.more:
                last = await _ended(st, request_id, f.at)
            if last:
                ending = last if isinstance(last, StatusChange | RecordGone) else None
                async for event in _the_end(st, f, ending):
                    yield event
                return
            if both.more:
                continue  # more was written than one read takes: read on before waiting
            chunks, look_for_end = await f.wait(changed, idle_s)
            if not chunks and not look_for_end:
                yield None, f.at
                # A record can go without a word (its TTL, an operator): look after a silence.
                look_for_end = True
            elif any(c.end is not None for c in chunks):
                # The token stream ended: the terminal status follows, unless the record went.
                look_for_end = True


def _split(
    changes: list[tuple[str, dict[Any, Any]]],
) -> tuple[list[StatusChange], StatusChange | None]:
    """The status changes read, up to the terminal one, and the terminal one (or None)."""
    pending: list[StatusChange] = []
    for sid, fields in changes:
        change = StatusChange(sid, change_data(fields))
        if change.terminal:
            return pending, change
        pending.append(change)
    return pending, None


async def _the_end(
    st: ApiState, f: Follower, last: StatusChange | RecordGone | None
) -> AsyncIterator[tuple[Item, Position]]:
    """The tokens still unread (a worker writes them all before the terminal status), then
    the terminal status (or the word that the record went), unless the reader resumed past
    the terminal status (``last`` is None)."""
    while rest := await st.tokens.read(f.request_id, f.at.tokens):
        for chunk in rest:
            f.at = replace(f.at, tokens=chunk.id)
            yield chunk, f.at
    if isinstance(last, StatusChange):
        f.at = replace(f.at, status=last.id)
    if last is not None:
        yield last, f.at
