"""Request status records in Redis: folded from ResultEvents, deduplicated, never regressing.

Besides the record itself (``{prefix}:status:{id}``, JSON, with a TTL), every status *change*
is appended to a per-request Redis stream (``{prefix}:status-events:{id}``: the history that
Server-Sent Events replay and resume from) and announced on one pub/sub channel
(``{prefix}:status-notify``, message = request id), so long-polls and event streams wake on a
notification instead of polling. An update is one server-side compare-and-set script that
writes all three with the record, atomically, in one round trip.

Cancellation also lives here, because every floor above needs it: the API marks a request
cancelled (``{prefix}:cancel:{id}`` + a message on ``{prefix}:cancel``), and workers ask a
:class:`CancelWatch` before compute and between decode steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from schemas.types import TERMINAL_STATUSES, EncodedEvent, ErrorInfo, ResultEvent, now_ms

log = logging.getLogger(__name__)

_RANK = {"queued": 0, "encoding": 1, "prefilling": 2, "decoding": 3}
_TERMINAL_RANK = 4
STREAM_MAXLEN = 256
"""A request changes status a handful of times; the cap only bounds a misbehaving producer."""


def _rank(status: str) -> int:
    return _TERMINAL_RANK if status in TERMINAL_STATUSES else _RANK.get(status, 0)


def fold(record: dict[str, Any] | None, ev: ResultEvent) -> dict[str, Any] | None:
    """The record after applying one ResultEvent, or None when it changes nothing.

    Rules: the status only moves forward (queued < encoding < prefilling < decoding <
    terminal) and the first terminal status wins, so a redelivered or late event cannot undo
    an outcome (a ``completed`` after a ``cancelled`` changes nothing). Stage timings and info
    are merged; a (stage, status) pair already seen, with nothing new in its timings and
    info, is a duplicate (``stages`` keeps the first time of a pair, ``stages_last`` the last).
    """
    rec = record or new_record(ev.request_id, ev.created_ms)
    seen_key = f"{ev.stage}:{ev.status}"
    if seen_key in rec["stages"]:
        # A redelivery brings nothing new. Another item's update of the same stage (a second
        # image's "encode:encoding") does: its timings and info are kept.
        if all(rec["timings"].get(k) == v for k, v in ev.timings.items()) and all(
            rec["info"].get(k) == v for k, v in ev.info.items()
        ):
            return None
        rec.setdefault("stages_last", {})[seen_key] = ev.created_ms
    else:
        rec["stages"][seen_key] = ev.created_ms
    terminal = rec["status"] in TERMINAL_STATUSES
    rec["timings"].update(ev.timings)
    rec["info"].update(ev.info)
    if not terminal and _rank(ev.status) >= _rank(rec["status"]):
        rec["status"] = ev.status
        if ev.status in TERMINAL_STATUSES:
            rec["finished_ms"] = ev.created_ms
            rec["token_ids"] = ev.token_ids
            rec["text"] = ev.text
            rec["error"] = asdict(ev.error) if ev.error else None
    elif terminal and ev.status == rec["status"] and rec["token_ids"] is None and ev.token_ids:
        # The same outcome from the stage that did the work fills in what the first lacked: a
        # cancel from the API carries no tokens, the worker's carries those made before it.
        rec["token_ids"] = ev.token_ids
        rec["text"] = ev.text
    rec["updated_ms"] = now_ms()
    return rec


def encoded_update(ev: EncodedEvent, *, hop_ms: float | None = None) -> ResultEvent:
    """The status update an EncodedEvent stands for.

    The stage name carries the item's hash, so each item is recorded once (a redelivered
    EncodedEvent is a duplicate) while different items of one request all land. ``hop_ms``: the
    broker hop the encode event came through, which the encode worker adds to its own write of
    the mark (the EncodedEvent does not carry it).
    """
    short = ev.mm_hash[:12]
    info = {f"encoded.{short}": "cache_hit" if ev.cache_hit else "encoded"}
    timings = {} if ev.cache_hit else {f"encode.{short}": ev.encode_ms}
    if hop_ms is not None:
        timings[f"encode_hop.{short}"] = hop_ms
    if not ev.ok:
        info = {f"encode_failed.{short}": ev.error.code if ev.error else "error"}
        timings = {}
    return ResultEvent(
        request_id=ev.request_id,
        stage=f"encode.{short}",
        status="encoding",
        timings=timings,
        info=info,
        worker="",
        created_ms=ev.created_ms,
    )


def new_record(request_id: str, created_ms: int | None = None) -> dict[str, Any]:
    """An empty ``queued`` record."""
    return {
        "request_id": request_id,
        "status": "queued",
        "stages": {},
        "timings": {},
        "info": {},
        "token_ids": None,
        "text": None,
        "error": None,
        "created_ms": created_ms if created_ms is not None else now_ms(),
    }


# KEYS: record, its event stream, the in-flight set. ARGV: the record text the fold started
# from ("" = no record), the new text, TTL s, the stream entry ("" = the status did not
# change), the notify channel, the stream's cap, "1" when terminal, the request id, now (ms).
# Returns {1} once written, or {0, text Redis holds} when the start was stale. A request that
# is not finished is in the in-flight set whoever wrote its record (the API's admission adds it
# first; a router's or a submitter's record joins here), so the sweep sees every one of them.
_CAS_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if (current or '') ~= ARGV[1] then return {0, current} end
redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3])
if ARGV[7] == '1' then
    redis.call('ZREM', KEYS[3], ARGV[8])
else
    redis.call('ZADD', KEYS[3], 'NX', ARGV[9], ARGV[8])
    redis.call('EXPIRE', KEYS[3], ARGV[3])
end
if ARGV[4] ~= '' then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[4])
    redis.call('EXPIRE', KEYS[2], ARGV[3])
    redis.call('PUBLISH', ARGV[5], ARGV[8])
end
return {1}
"""


def _text(raw: Any) -> str | None:
    """A record's text as the client returned it (bytes or str), or None."""
    if raw is None:
        return None
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def _event_entry(rec: dict[str, Any], stage: str) -> str:
    """The JSON of one status change as it is kept in the request's event stream."""
    entry: dict[str, Any] = {
        "request_id": rec["request_id"],
        "status": rec["status"],
        "stage": stage,
        "at_ms": rec["updated_ms"],
    }
    if rec["status"] in TERMINAL_STATUSES:
        entry["token_ids"] = rec["token_ids"]
        entry["text"] = rec["text"]
        entry["error"] = rec["error"]
    return json.dumps(entry)


class StatusStore:
    """Status records under ``{prefix}:status:{request_id}`` with a TTL."""

    CONNECTION_RETRIES = 3
    """Tries of one update over connections Redis dropped (stale after a Redis restart)."""

    REMEMBER = 1024
    """Records this process last saw, kept as the starting guess of its next update (a worker
    writes again within milliseconds of its last read or write; an API replica reads many)."""
    REMEMBER_CHARS = 16 * 1024 * 1024
    """...and at most this many characters of them: a count alone let a few huge records (a
    30 MB metadata value, before the API bounded it) hold hundreds of MB in every process."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "epd", ttl_s: int = 3600) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self._cas = client.register_script(_CAS_SCRIPT)
        self._known: OrderedDict[str, str] = OrderedDict()
        self._known_chars = 0

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:status:{request_id}"

    def events_key(self, request_id: str) -> str:
        """The request's stream of status changes (ids are Redis stream ids)."""
        return f"{self.prefix}:status-events:{request_id}"

    @property
    def notify_channel(self) -> str:
        """Pub/sub channel announcing every status change (the message is the request id)."""
        return f"{self.prefix}:status-notify"

    @property
    def inflight_key(self) -> str:
        """Sorted set of unfinished requests (score: admission, or first record, time in ms)."""
        return f"{self.prefix}:inflight"

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """The status record of a request, or None when unknown or expired."""
        text = await self._read(request_id)
        return json.loads(text) if text else None

    def _queue_change(self, pipe: Any, rec: dict[str, Any], stage: str) -> None:
        """Queue the stream entry, its TTL and the notification of one status change."""
        rid = rec["request_id"]
        pipe.xadd(
            self.events_key(rid),
            {"data": _event_entry(rec, stage)},
            maxlen=STREAM_MAXLEN,
            approximate=True,
        )
        pipe.expire(self.events_key(rid), self.ttl_s)
        if rec["status"] in TERMINAL_STATUSES:
            pipe.zrem(self.inflight_key, rid)
        else:
            pipe.zadd(self.inflight_key, {rid: rec["updated_ms"]}, nx=True)
            pipe.expire(self.inflight_key, self.ttl_s)
        pipe.publish(self.notify_channel, rid)

    async def create(self, request_id: str, fields: dict[str, Any]) -> bool:
        """Create a ``queued`` record carrying ``fields`` (owner, items...); False if it exists.

        The first entry of the event stream is this ``queued`` status.
        """
        rec = new_record(request_id)
        rec.update(fields)
        rec["stages"]["api:queued"] = rec["created_ms"]
        rec["updated_ms"] = rec["created_ms"]
        text = json.dumps(rec)
        dropped = 0
        while True:
            try:
                return await self._create(request_id, rec, text)
            except RedisConnectionError:
                # A pooled connection Redis dropped (a restart, a freeze): again on a fresh one.
                # Safe even if the SET ran: a record holding this very text is ours.
                dropped += 1
                if dropped >= self.CONNECTION_RETRIES:
                    raise
                await asyncio.sleep(0.05 * dropped)

    async def _create(self, request_id: str, rec: dict[str, Any], text: str) -> bool:
        if not await self.client.set(self.key(request_id), text, ex=self.ttl_s, nx=True):
            if _text(await self.client.get(self.key(request_id))) != text:
                return False
        self._remember(request_id, text)
        async with self.client.pipeline(transaction=True) as pipe:
            self._queue_change(pipe, rec, "api")
            await pipe.execute()
        return True

    async def update_fields(self, request_id: str, fields: dict[str, Any]) -> None:
        """Merge top-level ``fields`` into an existing record (no status change)."""
        await self._modify(request_id, lambda rec: (rec.update(fields), rec)[1] if rec else None)

    async def delete(self, request_id: str) -> None:
        """Forget a request entirely (a request that was never enqueued)."""
        await self.client.delete(self.key(request_id), self.events_key(request_id))
        await self.client.zrem(self.inflight_key, request_id)

    async def apply(self, ev: ResultEvent) -> bool:
        """Fold one ResultEvent into its record atomically; False when it was a duplicate."""
        return await self._modify(ev.request_id, lambda rec: fold(rec, ev), stage=ev.stage)

    async def end_if_unchanged(self, ev: ResultEvent, seen_updated_ms: int) -> bool:
        """Fold the outcome ``ev`` only into a record that is unfinished and unchanged since it
        was judged (its ``updated_ms`` still ``seen_updated_ms``); True when it was written.
        For a judge that read the record earlier (the sweep): a stage that moved the request on
        in between wins, and the judge sends no second outcome."""

        def change(rec: dict[str, Any] | None) -> dict[str, Any] | None:
            if rec is None or rec["status"] in TERMINAL_STATUSES:
                return None
            if rec.get("updated_ms") != seen_updated_ms:
                return None
            return fold(rec, ev)

        return await self._modify(ev.request_id, change, stage=ev.stage)

    async def _modify(
        self,
        request_id: str,
        change: Callable[[dict[str, Any] | None], dict[str, Any] | None],
        stage: str = "api",
    ) -> bool:
        """Fold ``change`` into the record with one compare-and-set script per try.

        The script writes only if the record still holds the text the fold started from, and
        otherwise answers with the text it holds, so the common case is one round trip (a
        WATCH transaction took three). The starting text is this process's last sight of the
        record (:attr:`_known`), else what a read finds; a stale one costs one more try, never
        a lost update. A remembered text that says "nothing to change" is checked against
        Redis first.
        """
        dropped = 0
        while True:
            try:
                return await self._fold_in(request_id, change, stage)
            except RedisConnectionError:
                # A pooled connection Redis dropped (a restart, a freeze): fold again on a
                # fresh one. Safe even if the script ran: the same update folds as a duplicate.
                dropped += 1
                if dropped >= self.CONNECTION_RETRIES:
                    raise
                self._remember(request_id, None)
                await asyncio.sleep(0.05 * dropped)

    async def _fold_in(
        self,
        request_id: str,
        change: Callable[[dict[str, Any] | None], dict[str, Any] | None],
        stage: str,
    ) -> bool:
        key = self.key(request_id)
        expected, verified = self._known.get(request_id), False
        if expected is None:
            # Nothing remembered: read first. Most such updates (the results collector's
            # copies of what the stages wrote through) then fold to nothing, and a write
            # would only have sent a whole record to be refused.
            expected, verified = await self._read(request_id), True
        while True:
            old = json.loads(expected) if expected else None
            old_status = old["status"] if old else None  # before: ``change`` may edit ``old``
            rec = change(old)
            if rec is None:
                if verified:
                    return False
                # A remembered record may be older than Redis's (or gone): look before
                # concluding there is nothing to do.
                expected, verified = await self._read(request_id), True
                continue
            text = json.dumps(rec)
            entry = _event_entry(rec, stage) if rec["status"] != old_status else ""
            reply = await self._cas(
                keys=[key, self.events_key(request_id), self.inflight_key],
                args=[
                    expected or "",
                    text,
                    self.ttl_s,
                    entry,
                    self.notify_channel,
                    STREAM_MAXLEN,
                    "1" if rec["status"] in TERMINAL_STATUSES else "",
                    request_id,
                    now_ms(),
                ],
            )
            if int(reply[0]) == 1:
                self._remember(request_id, text)
                return True
            # Another writer got there first: fold again on what Redis holds.
            expected = _text(reply[1] if len(reply) > 1 else None)
            verified = True
            self._remember(request_id, expected)

    async def warm(self) -> None:
        """Load the update script and open a connection now, so a worker's first update is as
        quick as the next ones (redis-py would load the script on its first NOSCRIPT answer:
        three round trips and a connection set-up, enough for a request's outcome, written by
        another worker, to overtake an encoder's first mark)."""
        await self.client.script_load(_CAS_SCRIPT)

    async def _read(self, request_id: str) -> str | None:
        """The record's text as Redis holds it now (remembered for the next update)."""
        text = _text(await self.client.get(self.key(request_id)))
        self._remember(request_id, text)
        return text

    def _remember(self, request_id: str, text: str | None) -> None:
        known = self._known
        dropped = known.pop(request_id, None)
        if dropped is not None:
            self._known_chars -= len(dropped)
        if text is None:
            return
        known[request_id] = text
        self._known_chars += len(text)
        while known and (len(known) > self.REMEMBER or self._known_chars > self.REMEMBER_CHARS):
            _, old = known.popitem(last=False)
            self._known_chars -= len(old)

    async def events(self, request_id: str, after: str = "0") -> list[tuple[str, dict[str, Any]]]:
        """Status changes after stream id ``after`` (exclusive), oldest first."""
        start = "-" if after in ("", "0") else f"({after}"
        rows: Any = await self.client.xrange(self.events_key(request_id), min=start, max="+")
        out: list[tuple[str, dict[str, Any]]] = []
        for sid, fields in rows or []:
            data = fields.get(b"data") or fields.get("data")
            out.append((sid.decode() if isinstance(sid, bytes) else str(sid), json.loads(data)))
        return out

    # -------------------------------------------------------------- admission (in-flight bound)

    _ADMIT = """
    redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
    if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
    redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
    redis.call('EXPIRE', KEYS[1], ARGV[5])
    return 1
    """

    async def admit(self, request_id: str, limit: int) -> bool:
        """Count ``request_id`` as in flight unless ``limit`` requests already are (atomic,
        shared by every API replica). Entries older than the record TTL are dropped, so a
        request whose outcome never arrives cannot hold a slot forever."""
        now = now_ms()
        ok = await self.client.eval(
            self._ADMIT,
            1,
            self.inflight_key,
            now - self.ttl_s * 1000,
            limit,
            now,
            request_id,
            self.ttl_s,
        )
        return bool(ok)

    async def release(self, request_id: str) -> None:
        """Give back an in-flight slot (a request that was not enqueued after all)."""
        await self.client.zrem(self.inflight_key, request_id)

    async def in_flight(self) -> int:
        """Admitted requests without an outcome yet."""
        return int(await self.client.zcard(self.inflight_key))

    async def in_flight_by_status(self, limit: int = 10000) -> dict[str, int]:
        """Unfinished requests counted by status (one MGET of at most ``limit`` records)."""
        ids: list[Any] = await self.client.zrange(self.inflight_key, 0, limit - 1)
        if not ids:
            return {}
        names = [i.decode() if isinstance(i, bytes) else str(i) for i in ids]
        raws = await self.client.mget([self.key(n) for n in names])
        counts: dict[str, int] = {}
        for raw in raws:
            if raw:
                status = json.loads(raw)["status"]
                counts[status] = counts.get(status, 0) + 1
        return counts

    # ------------------------------------------------------------------------ cancellation

    def cancel_key(self, request_id: str) -> str:
        return cancel_key(self.prefix, request_id)

    async def cancel(self, request_id: str, reason: str = "cancelled by the client") -> bool:
        """Mark a request cancelled: the flag workers check, a message to running workers, and
        the terminal ``cancelled`` status (False when the record was already terminal)."""
        await self.client.set(self.cancel_key(request_id), b"1", ex=self.ttl_s)
        await self.client.publish(cancel_channel(self.prefix), request_id)
        return await self.apply(
            ResultEvent(
                request_id=request_id,
                stage="api",
                status="cancelled",
                error=ErrorInfo("cancelled", reason),
            )
        )


def cancel_key(prefix: str, request_id: str) -> str:
    """The Redis key that marks ``request_id`` cancelled."""
    return f"{prefix}:cancel:{request_id}"


def cancel_channel(prefix: str) -> str:
    """Pub/sub channel on which cancels are announced (message = request id)."""
    return f"{prefix}:cancel"


class ChannelListener:
    """One pub/sub subscription, handing each message to ``on_message``; reconnects on errors.

    ``on_gap`` runs after a reconnect (messages may have been missed while disconnected), so
    waiters can re-read state instead of sleeping until their timeout.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        channel: str,
        on_message: Callable[[str], None],
        on_gap: Callable[[], None] | None = None,
    ) -> None:
        self.client = client
        self.channel = channel
        self.on_message = on_message
        self.on_gap = on_gap
        self.healthy = False
        self._task: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def start(self, timeout_s: float = 5.0) -> None:
        """Subscribe (in the background); waits up to ``timeout_s`` for the first subscription."""
        self._task = asyncio.create_task(self._run(), name=f"listen:{self.channel}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._subscribed.wait(), timeout_s)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        delay = 0.1
        first = True
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self.healthy = True
                self._subscribed.set()
                if not first and self.on_gap is not None:
                    self.on_gap()
                first = False
                delay = 0.1
                async for msg in pubsub.listen():
                    if msg.get("type") != "message":
                        continue
                    data = msg["data"]
                    self.on_message(data.decode() if isinstance(data, bytes) else str(data))
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                if self.healthy:
                    log.warning("pub/sub %s lost (%s); reconnecting", self.channel, exc)
                self.healthy = False
                if self.on_gap is not None:
                    self.on_gap()  # waiters re-read state rather than trusting a dead channel
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


def _forget(waiters: dict[str, set[Any]], request_id: str, waiter: Any) -> None:
    """Drop one waiter of ``request_id``, and the request's entry once it has none left."""
    left = waiters.get(request_id)
    if left is not None:
        left.discard(waiter)
        if not left:
            del waiters[request_id]


class StatusNotifier:
    """Wakes waiters of a request when its status changes (one subscription per process)."""

    def __init__(self, store: StatusStore) -> None:
        self.store = store
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self.listener = ChannelListener(
            store.client, store.notify_channel, self._wake, on_gap=self._wake_all
        )

    @property
    def healthy(self) -> bool:
        return self.listener.healthy

    async def start(self) -> None:
        await self.listener.start()

    async def close(self) -> None:
        await self.listener.close()

    def _wake(self, request_id: str) -> None:
        for ev in self._waiters.get(request_id, ()):
            ev.set()

    def _wake_all(self) -> None:
        for evs in self._waiters.values():
            for ev in evs:
                ev.set()

    @contextlib.asynccontextmanager
    async def watch(self, request_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set on the next change of ``request_id``; register *before* reading the
        record, so a change between the read and the wait is never missed. Clear it to re-arm."""
        ev = asyncio.Event()
        self._waiters.setdefault(request_id, set()).add(ev)
        try:
            yield ev
        finally:
            _forget(self._waiters, request_id, ev)

    async def wait_change(
        self, request_id: str, status: str | None, timeout_s: float
    ) -> dict[str, Any] | None:
        """The record once its status differs from ``status`` or is terminal, or as it is
        when ``timeout_s`` runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self.watch(request_id) as changed:
            while True:
                changed.clear()
                rec = await self.store.get(request_id)
                if rec is None or rec["status"] != status or rec["status"] in TERMINAL_STATUSES:
                    return rec
                left = deadline - loop.time()
                if left <= 0:
                    return rec
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)


class CancelWatch:
    """What workers ask before compute and between decode steps: is this request cancelled?

    ``is_cancelled`` reads the flag in Redis (authoritative, one round trip); ``cancelled_now``
    is a lock-free membership test of the ids announced on the cancel channel since start-up,
    cheap enough for the decode loop's compute thread.
    """

    def __init__(self, client: aioredis.Redis, prefix: str, *, remember: int = 10000) -> None:
        self.client = client
        self.prefix = prefix
        self.remember = remember
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self.listener = ChannelListener(client, cancel_channel(prefix), self._add)

    async def start(self) -> None:
        await self.listener.start()

    async def close(self) -> None:
        await self.listener.close()

    def _add(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > self.remember:
            self._ids.popitem(last=False)
        for fut in self._waiters.pop(request_id, ()):
            if not fut.done():
                fut.set_result(None)

    async def wait(self, request_id: str) -> None:
        """Return once a cancel of ``request_id`` is announced (at once if one was seen): what
        a worker races a long wait against, so a cancel does not leave it waiting out its
        timeout for work the cancel stopped (an embedding the encoder skipped)."""
        if request_id in self._ids:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(request_id, set()).add(fut)
        try:
            await fut
        finally:
            _forget(self._waiters, request_id, fut)

    def cancelled_now(self, request_id: str) -> bool:
        """True when a cancel of ``request_id`` has been seen (any thread may call this)."""
        return request_id in self._ids

    async def is_cancelled(self, request_id: str) -> bool:
        """True when ``request_id`` is cancelled; a Redis error counts as not cancelled (the
        status record already refuses any outcome after a cancel)."""
        if request_id in self._ids:
            return True
        try:
            found = bool(await self.client.exists(cancel_key(self.prefix, request_id)))
        except RedisError:
            return False
        if found:
            self._add(request_id)
        return found


CancelCheck = Callable[[str], Awaitable[bool]]


@dataclass(frozen=True, slots=True)
class RequestState:
    """What a worker reads of a request's status record before (re)doing its work."""

    status: str | None
    """The record's status; None when there is no record (never made, expired, or wiped)."""
    encoded: frozenset[str]
    """Items (``mm_hash[:12]``) the encode stage stored or found cached, per the record."""
    oldest_ms: int | None = None
    """The earliest stage update the record holds (epoch ms); None without a record."""
    records_since_ms: int | None = None
    """Only when asked for: a time (epoch ms, Redis clock) before which the Redis holding the
    records had not started. Errs early, by up to two seconds (the server reports its uptime
    in whole seconds of a clock it caches)."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def wiped(self) -> bool:
        """The record holds nothing from before Redis last started (a restart may have lost
        it). Known only when ``records_since_ms`` was asked for."""
        since = self.records_since_ms
        return since is not None and (self.oldest_ms is None or self.oldest_ms >= since)


def encoded_items(info: dict[str, Any]) -> frozenset[str]:
    """The short hashes a record's ``info`` marks ``encoded`` or ``cache_hit``."""
    return frozenset(
        k.removeprefix("encoded.")
        for k, v in info.items()
        if k.startswith("encoded.") and v in ("encoded", "cache_hit")
    )


class RequestReader:
    """Reads :class:`RequestState` for workers (prefill: replay skip, lost-embedding check)."""

    def __init__(self, status: StatusStore) -> None:
        self.status = status

    async def __call__(self, request_id: str, since: bool = False) -> RequestState | None:
        """The request's state (with ``records_since_ms`` when ``since``: two more round
        trips), or None when Redis cannot be read (the caller cannot tell)."""
        try:
            rec = await self.status.get(request_id)
            started: int | None = None
            if since:
                info: Any = await self.status.client.info("server")
                now_s, now_us = await self.status.client.time()
                now = int(now_s) * 1000 + int(now_us) // 1000
                started = now - (int(info["uptime_in_seconds"]) + 1) * 1000
        except (RedisError, OSError, KeyError, ValueError) as exc:
            log.warning("cannot read the state of %s: %r", request_id, exc)
            return None
        if rec is None:
            return RequestState(None, frozenset(), records_since_ms=started)
        stages = [int(t) for t in (rec.get("stages") or {}).values()]
        return RequestState(
            rec["status"],
            encoded_items(rec.get("info") or {}),
            oldest_ms=min(stages, default=int(rec.get("created_ms") or 0)),
            records_since_ms=started,
        )


RequestStateReader = Callable[..., Awaitable[RequestState | None]]
"""``(request_id, since=False)``: a :class:`RequestReader`, or a stand-in for one."""
