"""Per-request token streams in Redis: the decode loop writes tokens as it makes them, readers
(the API's SSE and OpenAI streams, the CLI) follow them.

Layout. One Redis stream per request, ``RedisKeys.tokens`` (``{prefix}:tokens:{request_id}``;
its entry ids are the resume points: an SSE ``Last-Event-ID``), with a TTL (``EPD_STREAM_TTL_S``,
renewed by every write) and a bounded length (``EPD_STREAM_MAX_ENTRIES``, trimmed approximately,
oldest first). Every write is announced on pub/sub (message: the request id), so a waiting reader
wakes on a notification instead of polling: on one Redis on one channel,
``RedisKeys.tokens_notify``, that each reading process subscribes to once; on a Redis Cluster on
the request's own sharded channel (``RedisKeys.token_changes``: the stream, its channel and the
request's other keys share its ``{request_id}`` hash tag, so a write is one script on one shard),
subscribed while someone waits on that request and for ``LINGER_S`` after (a reader that waits
again at once, chunk after chunk, does not subscribe again each time). Entry fields:

- ``t``: the chunk's token ids, comma separated; ``x``: the chunk's text, UTF-8, never half a
  character and never part of a stop string (the decode loop holds such text back);
- ``n`` / ``c``: tokens / characters in the stream up to and including this chunk (a reader
  that sees ``n`` jump by more than the chunk's length lost a write: the status record's final
  result is complete regardless);
- on the last entry only: ``end`` (the terminal status: ``completed``, ``cancelled``,
  ``expired``, ``failed``) and ``finish`` (``stop`` or ``length`` for a completed request).

Writing (:class:`TokenStreamWriter`, one per request, in the worker's event loop). ``push``
never waits: it buffers, and one background task writes what is buffered at most once per
``EPD_STREAM_INTERVAL_MS`` (the first tokens at once), so Redis sees a bounded rate per request
whatever the decode speed, and the decode loop is never slowed by Redis. A failed write is
logged and dropped. :meth:`TokenStreamWriter.close` writes the rest and the end entry; the
worker calls it *before* it writes the request's terminal status, so a reader that sees a
terminal record finds every token already in the stream (a client's cancel is the exception:
the record turns ``cancelled`` at once and the worker's end entry follows when it stops).
:meth:`TokenStreamWriter.resume` makes a retried request (a redelivery, a decode worker taking
over) continue the stream instead of repeating it: the tokens a request makes are
deterministic (greedy, or sampled with a seed that is fixed per request), so the writer skips
the ``n`` tokens and ``c`` characters already there.

A request that ends before it decodes (refused, expired, cancelled or failed while waiting for
its embeddings) has no stream at all: a reader watches the status record beside the stream
(``StatusNotifier``) and stops at a terminal status once the stream has nothing more.

Reading (:class:`TokenStreams`; one per process, ``await start()`` subscribes once):

- ``await streams.read(request_id, after="0")`` -> the chunks after entry id ``after``
  (``"0"``: from the start), oldest first, at most ``count``; ``[]`` when there are none (or
  the stream does not exist, e.g. it expired);
- ``await streams.wait(request_id, after, timeout_s)`` -> the same, waiting up to ``timeout_s``
  for a chunk to arrive (``[]`` when none did);
- ``async for chunk in streams.follow(request_id, after, idle_timeout_s)``: every chunk until
  the end entry (or until nothing arrives for ``idle_timeout_s``).

Each :class:`TokenChunk` has ``id`` (resume from it), ``token_ids``, ``text``, ``tokens_total``,
``chars_total``, and ``end`` / ``finish_reason`` (None but on the last).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from runtime.redis.cluster import RedisClient, is_cluster_client
from runtime.redis.sharded_pubsub import ShardedChannels
from runtime.redis.stream_ids import NEXT_ID_LUA, entry_order, range_after
from runtime.status.listener import ChannelListener, RequestEvents
from schemas.keys import RedisKeys

if TYPE_CHECKING:
    from runtime.settings import Settings

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0
"""Longest :meth:`TokenStreamWriter.close` waits for Redis: a frozen Redis must not hold up
the request's outcome (the status record carries the whole result anyway)."""

LINGER_S = 1.0
"""Redis Cluster: how long a request's channel stays subscribed after its last waiter left."""
RESUBSCRIBE_S = 0.5
"""Redis Cluster: how long a reader whose channel could not be subscribed (its master is
failing over) sleeps before it reads again and retries the subscription."""

# KEYS: the stream, the request's status-change stream (the entry's id follows both:
# ``runtime.redis.stream_ids``), and for a guarded write the request's status record. ARGV:
# its cap, TTL (s), the channel, the request id, the publish command, then the entry's
# field/value pairs. Returns 0, writing nothing, when the record it is guarded by is gone. On
# a cluster the streams, the record and the channel share the request's slot.
_APPEND_SCRIPT = (
    NEXT_ID_LUA
    + """
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
local id = next_stream_id(KEYS[1], KEYS[2])
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], id, unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call(ARGV[5], ARGV[3], ARGV[4])
return 1
"""
)


# KEYS: the status-change stream, the token stream. ARGV: the first ids to read of each
# (``-``, or ``(ID``: after ID), the most token entries to read. Both in one atomic read.
_BOTH_SCRIPT = """
return {
    redis.call('XRANGE', KEYS[1], ARGV[1], '+'),
    redis.call('XRANGE', KEYS[2], ARGV[2], '+', 'COUNT', ARGV[3]),
}
"""


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """One entry of a request's token stream."""

    id: str
    """The entry id (resume after it: ``read(request_id, after=chunk.id)``)."""
    token_ids: list[int]
    text: str
    tokens_total: int
    chars_total: int
    end: str | None = None
    """The request's terminal status, on the stream's last entry only."""
    finish_reason: str | None = None
    """``stop`` or ``length``, on the last entry of a completed request."""

    @classmethod
    def from_entry(cls, entry_id: Any, fields: Any) -> TokenChunk:
        """A chunk from one stream entry as redis-py returns it (bytes keys and values)."""
        f = {_s(k): _s(v) for k, v in (fields or {}).items()}
        tokens = f.get("t", "")
        return cls(
            id=_s(entry_id),
            token_ids=[int(t) for t in tokens.split(",")] if tokens else [],
            text=f.get("x", ""),
            tokens_total=int(f.get("n", "0")),
            chars_total=int(f.get("c", "0")),
            end=f.get("end") or None,
            finish_reason=f.get("finish") or None,
        )


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _pairs(flat: Any) -> dict[Any, Any]:
    """A stream entry's fields as a script returns them (a flat list) as a dict."""
    items = list(flat or [])
    return dict(zip(items[0::2], items[1::2], strict=True))


@dataclass(frozen=True, slots=True)
class BothStreams:
    """What one atomic read of a request's two streams found (:meth:`TokenStreams.read_both`).
    The two streams' ids are in write order together (``runtime.redis.stream_ids``), so the
    entries sorted by id are the request's events as they were written."""

    changes: list[tuple[str, dict[Any, Any]]]
    """Status-change entries: their ids and fields (``data``: the change's JSON)."""
    chunks: list[TokenChunk]
    more: bool
    """The token read stopped at its count: the status changes written after the last chunk
    read are left for the next read (tokens written before them may not be read yet)."""


class TokenStreams:
    """Token streams under one prefix: writers for workers, reads and waits for readers."""

    def __init__(
        self,
        client: RedisClient,
        prefix: str,
        *,
        interval_s: float = 0.02,
        ttl_s: int = 3600,
        max_entries: int = 4096,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.cluster = is_cluster_client(client)
        self.keys = RedisKeys(prefix, cluster=self.cluster)
        self.channel = self.keys.tokens_notify
        self._waiters = RequestEvents()
        self._listener: ChannelListener | None = None
        self._sharded: ShardedChannels | None = None
        self._lingering: dict[str, asyncio.TimerHandle] = {}
        self._leaving: set[asyncio.Task[None]] = set()
        self._append = client.register_script(_APPEND_SCRIPT)
        self._both = client.register_script(_BOTH_SCRIPT)

    @classmethod
    def from_settings(cls, client: RedisClient, settings: Settings) -> TokenStreams:
        """Streams with the deployment's ``EPD_STREAM_*`` settings."""
        return cls(
            client,
            settings.topic_prefix,
            interval_s=settings.stream_interval_ms / 1000,
            ttl_s=settings.stream_ttl_s,
            max_entries=settings.stream_max_entries,
        )

    def key(self, request_id: str) -> str:
        return self.keys.tokens(request_id)

    def writer(
        self, request_id: str, on_gone: Callable[[str], object] | None = None
    ) -> TokenStreamWriter:
        """A writer for one request's stream (the worker's side). ``on_gone``: its writes are
        guarded by the request's status record: none is written once the record is gone (a
        stream is never made again for a request nobody can read), and ``on_gone`` is told
        the request id, once."""
        return TokenStreamWriter(self, request_id, on_gone)

    # --------------------------------------------------------------------------- reading

    async def start(self) -> None:
        """Subscribe to the notify channel (once per process; ``wait`` starts it itself). On a
        cluster: ready the sharded subscriptions (each request's channel is subscribed when a
        reader waits on it)."""
        if self.cluster:
            if self._sharded is None:
                assert isinstance(self.client, RedisCluster)
                self._sharded = ShardedChannels(self.client, self._heard, self._lost)
            return
        if self._listener is None:
            self._listener = ChannelListener(
                self.client, self.channel, self._waiters.wake, on_gap=self._waiters.wake_all
            )
            await self._listener.start()

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        for timer in self._lingering.values():
            timer.cancel()
        self._lingering.clear()
        for task in list(self._leaving):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._sharded is not None:
            await self._sharded.close()
            self._sharded = None

    # ------------------------------------------- cluster: one channel per waited-on request

    def _channel(self, request_id: str) -> bytes:
        return self.keys.token_changes(request_id).encode()

    def _heard(self, channel: bytes, data: bytes) -> None:
        self._waiters.wake(data.decode())

    def _lost(self, channels: frozenset[bytes]) -> None:
        """Channels went deaf (their master died or their slot moved): their readers read
        again, and subscribe again where the slot lives now."""
        for rid in self._waiters.requests():
            if self._channel(rid) in channels:
                self._waiters.wake(rid)

    async def _follow(self, request_id: str) -> bool:
        """Cluster: make sure the request's channel is subscribed (confirmed) before a read;
        False when it cannot be now (the reader then polls, briefly, until it can)."""
        timer = self._lingering.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        sharded = self._sharded
        if sharded is None:
            return True
        try:
            await sharded.subscribe([self._channel(request_id)])
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("token channel of %s not subscribed yet (%r)", request_id, exc)
            return False
        return True

    def following(self, request_id: str) -> bool:
        """Cluster: whether the request's channel is subscribed now (False on one Redis,
        whose one channel is subscribed by :meth:`start`)."""
        return self._sharded is not None and self._sharded.subscribed(self._channel(request_id))

    def _linger(self, request_id: str) -> None:
        """Cluster: the last reader of ``request_id`` left; unsubscribe after ``LINGER_S``
        unless another comes."""
        if self._sharded is None or request_id in self._lingering:
            return

        def leave() -> None:
            self._lingering.pop(request_id, None)
            if request_id in self._waiters or self._sharded is None:
                return
            task = asyncio.get_running_loop().create_task(
                self._sharded.unsubscribe([self._channel(request_id)])
            )
            self._leaving.add(task)
            task.add_done_callback(self._leaving.discard)

        self._lingering[request_id] = asyncio.get_running_loop().call_later(LINGER_S, leave)

    async def append(
        self, request_id: str, fields: dict[str, str], *, guarded: bool = False
    ) -> bool:
        """Append one entry to the request's stream, renew its TTL and announce it, in one
        atomic step (a script, on a cluster on the request's shard). ``guarded``: only while
        the request's status record exists; False (nothing written) when it is gone."""
        keys = [self.key(request_id), self.keys.status_events(request_id)]
        if guarded:
            keys.append(self.keys.status(request_id))
        flat = [part for pair in fields.items() for part in pair]
        channel = self.keys.token_changes(request_id) if self.cluster else self.channel
        publish = "SPUBLISH" if self.cluster else "PUBLISH"
        args: list[str | int] = [
            self.max_entries,
            self.ttl_s,
            channel,
            request_id,
            publish,
            *flat,
        ]
        return bool(int(await self._append(keys=keys, args=args)))

    async def read(self, request_id: str, after: str = "0", count: int = 1000) -> list[TokenChunk]:
        """The chunks after entry id ``after`` (``"0"``: all), oldest first, at most ``count``."""
        entries = await self.client.xrange(
            self.key(request_id), min=range_after(after), max="+", count=count
        )
        return [TokenChunk.from_entry(i, f) for i, f in entries or []]

    async def read_both(
        self, request_id: str, status_after: str, tokens_after: str, count: int = 1000
    ) -> BothStreams:
        """The request's status changes after ``status_after`` and its chunks after
        ``tokens_after``, read at one instant (a script), so that nothing written between two
        reads can make the order of what was read differ from the order it was written in."""
        keys = [self.keys.status_events(request_id), self.key(request_id)]
        changes, entries = await self._both(
            keys=keys, args=[range_after(status_after), range_after(tokens_after), count]
        )
        rows = [(_s(i), _pairs(f)) for i, f in changes or []]
        chunks = [TokenChunk.from_entry(i, _pairs(f)) for i, f in entries or []]
        more = len(chunks) >= count
        if more:
            last = entry_order(chunks[-1].id)
            rows = [(i, f) for i, f in rows if entry_order(i) < last]
        return BothStreams(rows, chunks, more)

    async def wait(
        self, request_id: str, after: str = "0", timeout_s: float = 15.0, count: int = 1000
    ) -> list[TokenChunk]:
        """The chunks after ``after``, waiting up to ``timeout_s`` for one to be written."""
        await self.start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Registered (and on a cluster subscribed) before the read, so a write between the
        # read and the wait is not missed.
        woke = self._waiters.add(request_id)
        try:
            while True:
                woke.clear()
                heard = await self._follow(request_id)
                chunks = await self.read(request_id, after, count)
                left = deadline - loop.time()
                if chunks or left <= 0:
                    return chunks
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(woke.wait(), left if heard else min(left, RESUBSCRIBE_S))
        finally:
            self._waiters.forget(request_id, woke)
            if request_id not in self._waiters:
                self._linger(request_id)

    async def follow(
        self, request_id: str, after: str = "0", idle_timeout_s: float = 60.0
    ) -> AsyncIterator[TokenChunk]:
        """Every chunk after ``after`` as it arrives, through the end entry; stops early when
        nothing arrives for ``idle_timeout_s``."""
        while True:
            chunks = await self.wait(request_id, after, idle_timeout_s)
            if not chunks:
                return
            for chunk in chunks:
                yield chunk
                if chunk.end is not None:
                    return
            after = chunks[-1].id


class TokenStreamWriter:
    """Writes one request's tokens to its stream in bounded-rate batches (see the module)."""

    def __init__(
        self,
        streams: TokenStreams,
        request_id: str,
        on_gone: Callable[[str], object] | None = None,
    ) -> None:
        self.streams = streams
        self.request_id = request_id
        self.on_gone = on_gone
        self.gone = False
        """A guarded write found the request's status record gone (nothing is written after)."""
        self.key = streams.key(request_id)
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._total_tokens = 0
        self._total_chars = 0
        self._skip_tokens = 0
        self._skip_chars = 0
        self._last_write = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._writing = False
        """The drain task is writing an entry now (else it waits, or has not started)."""
        self._closing = False
        self._closed = False
        self.writes = 0
        """Entries written so far (the end entry included)."""

    async def resume(self) -> int:
        """Continue a stream an earlier attempt of this request began: the tokens and text
        pushed next are dropped until they pass what is there already. Returns the number of
        tokens there (0 for a new stream, and when Redis cannot tell)."""
        try:
            last = await self.streams.client.xrevrange(self.key, max="+", min="-", count=1)
        except RedisError as exc:
            log.warning("token stream %s: cannot read its end (%r)", self.key, exc)
            return 0
        if not last:
            return 0
        entry_id, fields = last[0]
        chunk = TokenChunk.from_entry(entry_id, fields)
        self._skip_tokens = chunk.tokens_total - self._total_tokens
        self._skip_chars = chunk.chars_total - self._total_chars
        self._total_tokens, self._total_chars = chunk.tokens_total, chunk.chars_total
        return chunk.tokens_total

    def push(self, token_ids: Sequence[int], text: str) -> None:
        """Buffer tokens and their text; written soon, in the background. Never waits."""
        if self._closed:
            return
        tokens = list(token_ids)
        if self._skip_tokens:
            dropped = min(self._skip_tokens, len(tokens))
            tokens, self._skip_tokens = tokens[dropped:], self._skip_tokens - dropped
        if self._skip_chars:
            dropped = min(self._skip_chars, len(text))
            text, self._skip_chars = text[dropped:], self._skip_chars - dropped
        if not tokens and not text:
            return
        self._tokens.extend(tokens)
        self._text.append(text)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name=f"tokens:{self.request_id}")

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while (self._tokens or self._text) and not self._closing:
            due = self._last_write + self.streams.interval_s - loop.time()
            if due > 0:
                await asyncio.sleep(due)  # what close cancels
            self._writing = True
            try:
                await self._write()
            finally:
                self._writing = False

    async def _write(self, end: str | None = None, finish_reason: str | None = None) -> None:
        tokens, text = self._tokens, "".join(self._text)
        self._tokens, self._text = [], []
        self._total_tokens += len(tokens)
        self._total_chars += len(text)
        fields: dict[str, str] = {
            "t": ",".join(map(str, tokens)),
            "x": text,
            "n": str(self._total_tokens),
            "c": str(self._total_chars),
        }
        if end is not None:
            fields["end"] = end
            fields["finish"] = finish_reason or ""
        self._last_write = asyncio.get_running_loop().time()
        if self.gone:
            return
        guarded = self.on_gone is not None
        try:
            written = await self.streams.append(self.request_id, fields, guarded=guarded)
        except (RedisError, OSError) as exc:
            log.warning("token stream %s: a write failed (%r); it is dropped", self.key, exc)
            return
        if written:
            self.writes += 1
            return
        self.gone, self._closed = True, True
        log.info("token stream %s: the request's status record is gone; not written", self.key)
        if self.on_gone is not None:
            self.on_gone(self.request_id)

    async def close(self, status: str, finish_reason: str | None = None) -> None:
        """Write what is buffered and the end entry (``status``: the terminal status), bounded
        by ``CLOSE_TIMEOUT_S``; nothing pushed after this is written."""
        self._closed = True
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self._stop_draining()
                await self._write(end=status, finish_reason=finish_reason)
        except TimeoutError:
            log.warning("token stream %s: the end entry timed out", self.key)

    async def _stop_draining(self) -> None:
        """End the background writes: a write under way finishes, a wait for the interval is
        cut short. What is still buffered then goes out with the end entry (one write where
        two would be)."""
        self._closing = True
        task = self._task
        if task is None or task.cancelled():
            return
        if task.done():
            await task  # its failure, if it failed, is the close's
            return
        if not self._writing:
            task.cancel()
        await asyncio.wait({task})

    async def abandon(self) -> None:
        """Stop writing without an end entry (the request will be retried: its next attempt
        resumes the stream)."""
        self._closed = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
