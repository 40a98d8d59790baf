"""Request status records in Redis: folded from ResultEvents, deduplicated, never regressing.

Besides the record itself (``RedisKeys.status``, JSON, with a TTL), every status *change* is
appended to a per-request Redis stream (``RedisKeys.status_events``: the history that
Server-Sent Events replay and resume from) and announced on pub/sub (``RedisKeys.status_notify``,
message = request id), so long-polls and event streams wake on a notification instead of
polling. An update is one server-side compare-and-set script that writes all three with the
record, atomically, in one round trip. The fold itself is :mod:`schemas.status_record`; the
in-flight set is :mod:`runtime.status.inflight`, cancels :mod:`runtime.status.cancel`.

Only a request's entry point makes its record: the intake (:meth:`StatusStore.create`, with the
tenant, metadata and front) or, for a request an external renderer sent, the render router
(its fan-out's update, :func:`~schemas.status_record.makes_record`, and its dead letters,
:meth:`StatusStore.start`). Every other write (a stage's transitions and outcome, the
results collector's fold, the sweep, a cancel, a dead letter's outcome) folds into the record
it finds and never makes one: the compare-and-set starts from the text it read, so a record
that went meanwhile (its TTL, an eviction, an operator, a Redis restart) is not rebuilt
without its tenant and front, and the update raises :class:`StatusGone` instead (after a
notification, so that whoever follows the request looks again and finds it gone).
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from runtime.redis.cluster import RedisClient, is_cluster_client
from runtime.redis.stream_ids import NEXT_ID_LUA, range_after
from runtime.settings import Settings
from runtime.status.cancel import announce_cancel
from runtime.status.inflight import InFlight
from schemas.keys import RedisKeys
from schemas.status_record import StatusRecord, created, fold, fold_steps, makes_record
from schemas.types import ErrorInfo, ResultEvent, now_ms


class StatusGone(LookupError):
    """The request has no status record (it went: its TTL, an eviction, an operator, a Redis
    restart; or it never had one): an update folds into an existing record only."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"the status record of {request_id} is gone")
        self.request_id = request_id


RecordChange = Callable[[StatusRecord | None], StatusRecord | None]
"""The record before -> the record after, or None when nothing is to be written."""
RecordSteps = Callable[[StatusRecord | None], list[tuple[StatusRecord, str]]]
"""The record before -> the record after each update that changed it, with that update's
stage (empty when nothing is to be written): each status change among them is a stream entry."""

STREAM_MAXLEN = 256
"""A request changes status a handful of times; the cap only bounds a misbehaving producer."""


# KEYS: record, its event stream, its token stream (the entry's id follows both streams:
# ``runtime.redis.stream_ids``), and on one Redis the in-flight set. ARGV: the record text
# the fold started from ("" = no record: only a create passes it; an update passes the text
# it read, so it never writes where the record went), the new text, TTL s, the change
# channel, the stream's cap, "1" when terminal, the request id, now (ms), the publish command
# (PUBLISH; SPUBLISH on a cluster, where the channel is in the request's slot), then the
# stream entries, one per status change (none: the status did not change). Returns {1} once
# written, or {0, text Redis holds} when the start was stale (nothing, when the record went:
# the update then finds it gone).
# A request that is not finished is in the in-flight set whoever wrote its record (the API's
# admission adds it first; a router's or a submitter's record joins here), so the sweep sees
# every one of them; on a cluster the set is another slot's, updated beside the script.
_CAS_SCRIPT = (
    NEXT_ID_LUA
    + """
local current = redis.call('GET', KEYS[1])
if (current or '') ~= ARGV[1] then return {0, current} end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
if KEYS[4] then
    if ARGV[6] == '1' then
        redis.call('ZREM', KEYS[4], ARGV[7])
    else
        redis.call('ZADD', KEYS[4], 'NX', ARGV[8], ARGV[7])
        redis.call('EXPIRE', KEYS[4], ARGV[3])
    end
end
for i = 10, #ARGV do
    local id = next_stream_id(KEYS[2], KEYS[3])
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], id, 'data', ARGV[i])
end
if #ARGV >= 10 then
    redis.call('EXPIRE', KEYS[2], ARGV[3])
    redis.call(ARGV[9], ARGV[4], ARGV[7])
end
return {1}
"""
)


def _also_setting(change: RecordChange, fields: dict[str, Any]) -> RecordChange:
    """``change``, then ``fields`` set on the record (a change of its own where ``change``
    had none and the record lacks them)."""

    def both(rec: StatusRecord | None) -> StatusRecord | None:
        changed = change(rec)
        base = changed if changed is not None else rec
        if base is None:
            return None
        if changed is None and all(base.fields.get(k) == v for k, v in fields.items()):
            return None
        return base.with_fields(fields)

    return both


def change_data(fields: dict[Any, Any]) -> dict[str, Any]:
    """The change one status-stream entry holds (its ``data`` field, JSON), from the entry's
    fields as a client returns them (bytes or str keys)."""
    data = fields.get(b"data") or fields.get("data") or "{}"
    return dict(json.loads(data))


def _text(raw: Any) -> str | None:
    """A record's text as the client returned it (bytes or str), or None."""
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _one(change: RecordChange, stage: str) -> RecordSteps:
    """``change`` as the steps of one update of ``stage``."""

    def steps(rec: StatusRecord | None) -> list[tuple[StatusRecord, str]]:
        made = change(rec)
        return [] if made is None else [(made, stage)]

    return steps


def _created_then(
    record: StatusRecord, first: ResultEvent | None, first_fields: dict[str, Any] | None
) -> RecordSteps:
    """The steps of a create: ``record`` where there is none, then ``first`` folded in (with
    ``first_fields`` set), each a step of its own."""
    change: RecordChange = lambda rec: None  # noqa: E731
    stage = "api"
    if first is not None:
        stage, change = first.stage, functools.partial(fold, ev=first)
        if first_fields:
            change = _also_setting(change, first_fields)

    def steps(rec: StatusRecord | None) -> list[tuple[StatusRecord, str]]:
        out: list[tuple[StatusRecord, str]] = []
        if rec is None:
            rec = record
            out.append((rec, "api"))
        after = change(rec)
        if after is not None:
            out.append((after, stage))
        return out

    return steps


def _entries(old: StatusRecord | None, steps: list[tuple[StatusRecord, str]]) -> list[str]:
    """The status-stream entries of ``steps`` from ``old``: one per status change (or the
    record made), with the stage of the update that made it."""
    out: list[str] = []
    for rec, stage in steps:
        if old is None or rec.status != old.status:
            out.append(rec.change_entry(stage))
        old = rec
    return out


class RememberedRecords:
    """The record texts a process last saw, by request id, newest kept: at most ``count`` of
    them and ``chars`` characters in all (a count alone let a few huge records, a 30 MB
    metadata value before the API bounded it, hold hundreds of MB in every process)."""

    def __init__(self, count: int, chars: int) -> None:
        self.count = count
        self.chars = chars
        self._texts: OrderedDict[str, str] = OrderedDict()
        self.held_chars = 0

    def get(self, request_id: str) -> str | None:
        return self._texts.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._texts

    def __len__(self) -> int:
        return len(self._texts)

    def put(self, request_id: str, text: str | None) -> None:
        """Remember ``text`` as the request's record (None: forget it)."""
        dropped = self._texts.pop(request_id, None)
        if dropped is not None:
            self.held_chars -= len(dropped)
        if text is None:
            return
        self._texts[request_id] = text
        self.held_chars += len(text)
        while self._texts and (len(self._texts) > self.count or self.held_chars > self.chars):
            _, old = self._texts.popitem(last=False)
            self.held_chars -= len(old)


class StatusStore:
    """Status records under ``RedisKeys.status`` with a TTL."""

    CONNECTION_RETRIES = 3
    """Tries of one update over connections Redis dropped (stale after a Redis restart)."""

    REMEMBER = 1024
    """Records this process last saw, kept as the starting guess of its next update (a worker
    writes again within milliseconds of its last read or write; an API replica reads many)."""
    REMEMBER_CHARS = 16 * 1024 * 1024
    """...and at most this many characters of them (:class:`RememberedRecords`)."""

    def __init__(self, client: RedisClient, *, prefix: str = "epd", ttl_s: int = 3600) -> None:
        self.client = client
        self.prefix = prefix
        self.cluster = is_cluster_client(client)
        self.keys = RedisKeys(prefix, cluster=self.cluster)
        self.ttl_s = ttl_s
        self.inflight = InFlight(client, self.keys, ttl_s=ttl_s)
        self._cas = client.register_script(_CAS_SCRIPT)
        self._known = RememberedRecords(self.REMEMBER, self.REMEMBER_CHARS)

    @classmethod
    def for_settings(cls, client: RedisClient, settings: Settings) -> StatusStore:
        """The store every stage, the API and the benches use: the pipeline's key prefix
        (``EPD_TOPIC_PREFIX``) and record lifetime (``EPD_STATUS_TTL_S``)."""
        return cls(client, prefix=settings.topic_prefix, ttl_s=settings.status_ttl_s)

    async def get(self, request_id: str) -> StatusRecord | None:
        """The status record of a request, or None when unknown or expired."""
        text = await self._read(request_id)
        return StatusRecord.from_json(text) if text else None

    async def create(
        self,
        request_id: str,
        fields: dict[str, Any],
        *,
        first: ResultEvent | None = None,
        first_fields: dict[str, Any] | None = None,
    ) -> bool:
        """Create a ``queued`` record carrying ``fields`` (owner, items...); False if it exists.

        The event stream's first entry is this ``queued``. One script run, like any update
        (writing only where no record is); it rides out a connection Redis dropped. ``first``
        (the fan-out's update, with its record ``first_fields``) is folded in by the same run,
        its own stream entry; a record that exists takes it as any update (True if changed)."""
        steps = _created_then(created(request_id, fields), first, first_fields)
        if await self._fold_steps(request_id, steps, absent=True, creates=True):
            return True
        # A connection dropped after the script ran, and the retry found the record: one that
        # holds this very text is ours.
        return self._known.get(request_id) == steps(None)[-1][0].to_json()

    async def update_fields(self, request_id: str, fields: dict[str, Any]) -> None:
        """Merge top-level ``fields`` into an existing record (no status change); nothing
        when there is none (:class:`StatusGone`)."""
        await self._modify(request_id, lambda rec: rec.with_fields(fields) if rec else None)

    async def delete(self, request_id: str) -> None:
        """Forget a request entirely (a request that was never enqueued)."""
        await self.client.delete(self.keys.status(request_id), self.keys.status_events(request_id))
        await self.client.zrem(self.keys.inflight, request_id)

    async def apply(self, ev: ResultEvent, *, fields: dict[str, Any] | None = None) -> bool:
        """Fold one ResultEvent into its existing record atomically, with top-level ``fields``
        set in the same write; False when it changed nothing (a duplicate). Raises
        :class:`StatusGone` when there is no record: an update never makes one (see the module
        docstring), but for the render router's fan-out update
        (:func:`~schemas.status_record.makes_record`)."""
        change: RecordChange = lambda rec: fold(rec, ev)  # noqa: E731
        if fields:
            change = _also_setting(change, fields)
        return await self._modify(ev.request_id, change, stage=ev.stage, creates=makes_record(ev))

    async def apply_all(self, events: Sequence[ResultEvent]) -> bool:
        """Fold several updates of one request, in order, in one write: each status change
        among them still gets its own stream entry. False when none changed anything; raises
        :class:`StatusGone` as :meth:`apply` does. (A stage whose updates queued up behind a
        slow one writes them together: one script run where there would be one per update.)"""
        if len(events) == 1:
            return await self.apply(events[0])
        creates = any(makes_record(ev) for ev in events)
        return await self._fold_steps(
            events[0].request_id, lambda rec: fold_steps(rec, events), creates=creates
        )

    async def start(self, ev: ResultEvent) -> bool:
        """:meth:`apply`, making the record when there is none: only for a word of a request's
        entry point that came in without the intake (the render router's dead letters: an
        external renderer's event it refused, which has no tenant or front to lose)."""
        return await self._modify(
            ev.request_id, lambda rec: fold(rec, ev), stage=ev.stage, creates=True
        )

    async def end_if_unchanged(self, ev: ResultEvent, seen_updated_ms: int) -> bool:
        """Fold the outcome ``ev`` only into a record that is unfinished and unchanged since it
        was judged (its ``updated_ms`` still ``seen_updated_ms``); True when it was written.
        For a judge that read the record earlier (the sweep): a stage that moved the request on
        in between wins, and the judge sends no second outcome."""

        def change(rec: StatusRecord | None) -> StatusRecord | None:
            if rec is None or rec.terminal or rec.updated_ms != seen_updated_ms:
                return None
            return fold(rec, ev)

        try:
            return await self._modify(ev.request_id, change, stage=ev.stage)
        except StatusGone:
            return False  # it went since the judge read it: nothing to end

    async def _modify(
        self,
        request_id: str,
        change: RecordChange,
        stage: str = "api",
        *,
        absent: bool = False,
        creates: bool = False,
    ) -> bool:
        """Fold ``change``, one update of ``stage``, into the record (:meth:`_fold_steps`)."""
        return await self._fold_steps(
            request_id, _one(change, stage), absent=absent, creates=creates
        )

    async def _fold_steps(
        self, request_id: str, steps: RecordSteps, *, absent: bool = False, creates: bool = False
    ) -> bool:
        """Fold ``steps`` into the record with one compare-and-set script per try.

        The script writes only if the record still holds the text the fold started from, and
        otherwise answers with the text it holds, so the common case is one round trip (a
        WATCH transaction took three). The starting text is this process's last sight of the
        record (:attr:`_known`), else what a read finds; a stale one costs one more try, never
        a lost update. A remembered text that says "nothing to change" is checked against
        Redis first. ``absent``: start from "no record" (a create), not from a read.
        ``creates``: ``steps`` may make the record; otherwise a fold that finds none raises
        :class:`StatusGone` and writes nothing.
        """
        dropped = 0
        while True:
            try:
                return await self._fold_in(request_id, steps, absent, creates)
            except RedisConnectionError:
                # A pooled connection Redis dropped (a restart, a freeze): fold again on a
                # fresh one. Safe even if the script ran: the same update folds as a duplicate.
                dropped += 1
                if dropped >= self.CONNECTION_RETRIES:
                    raise
                self._known.put(request_id, None)
                await asyncio.sleep(0.05 * dropped)

    async def _fold_in(
        self, request_id: str, steps: RecordSteps, absent: bool, creates: bool
    ) -> bool:
        expected, verified = ("" if absent else self._known.get(request_id)), False
        counted = False  # cluster: this call added the request to the in-flight set
        if expected is None:
            # Nothing remembered: read first. Most such updates (the results collector's
            # copies of what the stages wrote through) then fold to nothing, and a write
            # would only have sent a whole record to be refused.
            expected, verified = await self._read(request_id), True
        while True:
            old = StatusRecord.from_json(expected) if expected else None
            if old is None and verified and not creates:
                await self._gone(request_id, steps)
            made = steps(old)
            if not made:
                if verified:
                    if counted and old is not None and old.terminal:
                        await self.inflight.release(request_id)  # its outcome was out already
                    return False
                # A remembered record may be older than Redis's (or gone): look before
                # concluding there is nothing to do.
                expected, verified = await self._read(request_id), True
                continue
            rec = made[-1][0]
            if self.cluster and old is None and not rec.terminal and not counted:
                await self.inflight.add(request_id)  # before the record exists: see inflight
                counted = True
            text = rec.to_json()
            written, held = await self._write(request_id, expected, rec, text, _entries(old, made))
            if written:
                self._known.put(request_id, text)
                if self.cluster and rec.terminal and (counted or old is None or not old.terminal):
                    await self.inflight.release(request_id)
                return True
            # Another writer got there first: fold again on what Redis holds.
            expected = held
            verified = True
            self._known.put(request_id, expected)

    async def _write(
        self,
        request_id: str,
        expected: str | None,
        rec: StatusRecord,
        text: str,
        entries: list[str],
    ) -> tuple[bool, str | None]:
        """One compare-and-set run (with the status-stream ``entries``): ``(True, None)`` once
        written, else ``(False, the text Redis holds)`` for the next fold."""
        k = self.keys
        keys = [k.status(request_id), k.status_events(request_id), k.tokens(request_id)]
        if not self.cluster:
            keys.append(self.keys.inflight)
        channel = self.keys.status_changes(request_id) if self.cluster else self.keys.status_notify
        reply = await self._cas(
            keys=keys,
            args=[
                expected or "",
                text,
                self.ttl_s,
                channel,
                STREAM_MAXLEN,
                "1" if rec.terminal else "",
                request_id,
                now_ms(),
                "SPUBLISH" if self.cluster else "PUBLISH",
                *entries,
            ],
        )
        if int(reply[0]) == 1:
            return True, None
        return False, _text(reply[1] if len(reply) > 1 else None)

    async def _gone(self, request_id: str, steps: RecordSteps) -> None:
        """An update found no record: announce a change, so that a reader following the
        request (an event stream, a long-poll) looks now and finds it gone rather than waiting
        for a change that will not come; an outcome also gives back the request's in-flight
        slot (nothing else would: the sweep drops what is left later); then
        :class:`StatusGone`."""
        self._known.put(request_id, None)
        would = steps(None)
        try:
            if would and would[-1][0].terminal:
                await self.inflight.release(request_id)
            if self.cluster:
                await self.client.spublish(self.keys.status_changes(request_id), request_id)
            else:
                await self.client.publish(self.keys.status_notify, request_id)
        except RedisError:
            pass  # the readers still look on their next wake; the update is refused anyway
        raise StatusGone(request_id)

    async def warm(self) -> None:
        """Load the update script and open a connection now: a first update that loads it
        (NOSCRIPT, three round trips, a connect) let another worker's outcome overtake it."""
        await self.client.script_load(_CAS_SCRIPT)

    async def _read(self, request_id: str) -> str | None:
        """The record's text as Redis holds it now (remembered for the next update)."""
        text = _text(await self.client.get(self.keys.status(request_id)))
        self._known.put(request_id, text)
        return text

    async def events(self, request_id: str, after: str = "0") -> list[tuple[str, dict[str, Any]]]:
        """Status changes after stream id ``after`` (exclusive), oldest first."""
        rows: Any = await self.client.xrange(
            self.keys.status_events(request_id), min=range_after(after), max="+"
        )
        return [
            (sid.decode() if isinstance(sid, bytes) else str(sid), change_data(fields))
            for sid, fields in rows or []
        ]

    # ------------------------------------------- the in-flight set and cancels, by their owners

    async def admit(self, request_id: str, limit: int) -> bool:
        """:meth:`InFlight.admit` (the API's bound on unfinished requests)."""
        return await self.inflight.admit(request_id, limit)

    async def release(self, request_id: str) -> None:
        """:meth:`InFlight.release` (a request that was not enqueued after all)."""
        await self.inflight.release(request_id)

    async def in_flight(self) -> int:
        """:meth:`InFlight.count`: admitted requests without an outcome yet."""
        return await self.inflight.count()

    async def in_flight_by_status(self, limit: int = 10000) -> dict[str, int]:
        """:meth:`InFlight.by_status`: unfinished requests counted by status."""
        return await self.inflight.by_status(limit)

    async def cancel(self, request_id: str, reason: str = "cancelled by the client") -> bool:
        """Mark a request cancelled: the flag workers check, a message to running workers, and
        the terminal ``cancelled`` status (False when the record was already terminal, or is
        gone: no record is made for it)."""
        await announce_cancel(self.client, self.keys, request_id, ttl_s=self.ttl_s)
        try:
            return await self.apply(
                ResultEvent(
                    request_id=request_id,
                    stage="api",
                    status="cancelled",
                    error=ErrorInfo("cancelled", reason),
                )
            )
        except StatusGone:
            return False
