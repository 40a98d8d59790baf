"""``redis://host:port/db``: the multi-node embedding store.

Each value is one blob (header + raw little-endian bytes, see :mod:`runtime.stores.base`),
written with ``SET key blob PX ttl`` and ``PUBLISH <channel> key`` in one MULTI/EXEC, so a reader
that hears the notification always finds the value, and a put that fails part-way does neither.

I/O: on plain ``redis://`` URLs the data path (put, get, get_many, exists, delete and wait's
EXISTS) goes through :mod:`runtime.stores.redis_wire`, which parses replies with
``hiredis.Reader`` except a GET of 64 KiB or more, received straight into a ``bytearray`` of the
value's size, and sends a tensor's bytes from the tensor's own memory (the header and data are
never joined), so a put or get costs about what ``redis-benchmark`` does. A value read back is a
buffer of its own (``bytearray`` when large, else ``bytes``; the tensor viewing it is read-only in
spirit: copy before writing into it). ``rediss://`` (TLS) and
URLs carrying other redis-py connection options use redis-py for everything. Either way the
errors are the same: connection trouble is :class:`StoreUnavailable`, server error replies are
redis-py's exceptions. A tensor being put must not change until ``put`` returns (its memory is
sent as is).

Readiness: one pub/sub connection per store handle subscribes to a namespace channel and routes
each published key to the futures waiting on it. ``wait`` makes sure that subscription is
confirmed, registers its futures, and only then checks ``EXISTS``; a put landing in between is
therefore either seen by the check or heard on the channel, never lost. Pub/sub is global across
Redis DB numbers, so the default channel names the DB. The pub/sub connection does not retry: if it
drops, messages published meanwhile would be lost, so every pending ``wait`` fails with
:class:`StoreUnavailable` (transient; the consume loop retries) and the next ``wait`` resubscribes.
That includes a ``wait`` whose futures were registered just after the listener stopped (it failed
the waiters it knew of, not these): ``wait`` checks, right after registering and with no await
in between, that the listener it relies on is still live.

URL query parameters understood here (others go to redis-py): ``key_prefix`` (prepended to every
key, e.g. a tenant or test namespace) and ``channel`` (the readiness channel name);
``socket_timeout`` and ``socket_connect_timeout`` (seconds) apply to both I/O paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from runtime.redis.waiters import KeyedWaiters, wait_present
from runtime.stores import redis_wire as wire
from runtime.stores.base import (
    Blob,
    EmbeddingStore,
    decode_header,
    encode_header,
    expiry_ms,
    tensor_from_blob,
    tensor_view,
)
from runtime.stores.errors import StoreError, StoreKeyMissing, StoreTimeout, StoreUnavailable
from runtime.stores.url_options import url_count, url_seconds
from schemas.keys import store_ready_channel

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_OWN_PARAMS = ("key_prefix", "channel")
_WIRE_PARAMS = frozenset({"socket_timeout", "socket_connect_timeout", "max_connections"})
"""redis-py options the wire path honours too; a URL with any other option stays on redis-py."""
_UNAVAILABLE = (rexc.ConnectionError, rexc.TimeoutError, OSError)
_POOL_WAIT_S = 30.0
"""Longest a redis-py store command waits for a pooled connection (then StoreUnavailable)."""


@dataclass(eq=False, slots=True)
class _Listener:
    """One pub/sub subscription's lifetime; a new one replaces it once it stops."""

    confirmed: asyncio.Future[None]
    """Resolved when Redis confirms the SUBSCRIBE (failed if the listener stops first)."""
    task: asyncio.Task[None] | None = None
    pubsub: Any = None
    stopped: bool = False
    """Set the moment the listener can no longer deliver, before it fails any waiter."""

    @property
    def live(self) -> bool:
        """Whether notifications published from now on will reach the waiters."""
        return not self.stopped and self.task is not None and not self.task.done()


class _DataIO(Protocol):
    """The data-path commands, over redis-py or the wire client."""

    async def set_publish(
        self, key: bytes, header: bytes, data: memoryview, px: int | None, channel: bytes
    ) -> None: ...

    async def get(self, key: bytes) -> Blob | None: ...

    async def mget(self, keys: Sequence[bytes]) -> Sequence[Blob | None]: ...

    async def exists_each(self, keys: Sequence[bytes]) -> list[bool]: ...

    async def touch(self, key: bytes, px: int | None) -> bool: ...

    async def delete(self, key: bytes) -> None: ...

    async def close(self) -> None: ...


class _RedisPyIO:
    """Data path over redis-py (TLS, or options only redis-py understands)."""

    def __init__(self, conn_url: str, connect_timeout_s: float) -> None:
        # Blocking: a burst beyond the pool (default 50, ``?max_connections=`` in the URL) waits
        # for a free connection instead of failing with MaxConnectionsError.
        self._pool = aioredis.BlockingConnectionPool.from_url(
            conn_url,
            decode_responses=False,
            socket_connect_timeout=connect_timeout_s,
            timeout=_POOL_WAIT_S,
        )
        self._client = aioredis.Redis(connection_pool=self._pool)

    async def set_publish(
        self, key: bytes, header: bytes, data: memoryview, px: int | None, channel: bytes
    ) -> None:
        blob = b"".join((header, data))  # redis-py sends one argument from one buffer
        async with self._client.pipeline(transaction=True) as pipe:
            if px is None:
                pipe.set(key, blob)
            else:
                pipe.set(key, blob, px=px)
            pipe.publish(channel, key)
            await pipe.execute()

    async def get(self, key: bytes) -> Blob | None:
        value = await self._client.get(key)
        assert not isinstance(value, str)  # decode_responses=False
        return value

    async def mget(self, keys: Sequence[bytes]) -> Sequence[Blob | None]:
        # decode_responses=False: values are bytes or None
        return cast("list[bytes | None]", await self._client.mget(list(keys)))

    async def exists_each(self, keys: Sequence[bytes]) -> list[bool]:
        async with self._client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in await pipe.execute()]

    async def touch(self, key: bytes, px: int | None) -> bool:
        if px is not None:
            return bool(await self._client.pexpire(key, px))
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.persist(key)
            pipe.exists(key)
            _, present = await pipe.execute()
        return bool(present)

    async def delete(self, key: bytes) -> None:
        await self._client.delete(key)

    async def close(self) -> None:
        await self._client.aclose()
        await self._pool.disconnect()


class _WireIO:
    """Data path over :mod:`runtime.stores.redis_wire` (plain TCP)."""

    def __init__(self, pool: wire.WirePool) -> None:
        self.pool = pool

    async def set_publish(
        self, key: bytes, header: bytes, data: memoryview, px: int | None, channel: bytes
    ) -> None:
        await wire.set_and_publish(self.pool, key, (header, data), px, channel)

    async def get(self, key: bytes) -> Blob | None:
        return await wire.get(self.pool, key)

    async def mget(self, keys: Sequence[bytes]) -> Sequence[Blob | None]:
        return await wire.mget(self.pool, keys)

    async def exists_each(self, keys: Sequence[bytes]) -> list[bool]:
        return await wire.exists_each(self.pool, keys)

    async def touch(self, key: bytes, px: int | None) -> bool:
        return await wire.touch(self.pool, key, px)

    async def delete(self, key: bytes) -> None:
        await wire.delete(self.pool, key)

    async def close(self) -> None:
        self.pool.close()


def _px(ttl_s: float | None) -> int | None:
    """A TTL as Redis PX milliseconds (None: no expiry); raises ValueError for ttl_s <= 0."""
    expiry_ms(ttl_s)  # validates the TTL; Redis does the expiring itself
    return None if ttl_s is None else max(1, int(ttl_s * 1000))


def _wire_pool(url: str, connect_timeout_s: float) -> wire.WirePool | None:
    """A wire pool for ``url`` when the wire path can serve it exactly, else None."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    if parts.scheme != "redis" or not set(query) <= _WIRE_PARAMS:
        return None
    db_text = (parts.path or "/0").strip("/") or "0"
    if not db_text.isdigit():
        return None  # let redis-py report it
    connect = url_seconds(query, "socket_connect_timeout")
    return wire.WirePool(
        parts.hostname or "localhost",
        parts.port or 6379,
        int(db_text),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password is not None else None,
        connect_timeout_s=connect if connect is not None else connect_timeout_s,
        timeout_s=url_seconds(query, "socket_timeout"),
        max_connections=url_count(query, "max_connections", wire.MAX_CONNECTIONS),
    )


class RedisStore(EmbeddingStore):
    """Embedding store on a Redis server; see the module docstring."""

    def __init__(
        self, url: str, *, socket_connect_timeout_s: float = 5.0, wire_io: bool = True
    ) -> None:
        """Open a handle on ``url`` (no I/O yet). ``wire_io=False`` forces redis-py for the data
        path even where the wire client could serve it (tests compare the two)."""
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"not a redis:// URL: {url!r}")
        query = dict(parse_qsl(parts.query))
        own = {k: query.pop(k) for k in _OWN_PARAMS if k in query}
        self._url = url
        self._key_prefix = own.get("key_prefix", "")
        conn_url = urlunsplit(parts._replace(query=urlencode(query)))
        db = (parts.path or "/0").strip("/") or "0"
        self._channel = own.get("channel", store_ready_channel(db)).encode()
        pool = _wire_pool(conn_url, socket_connect_timeout_s) if wire_io else None
        self._io: _DataIO = (
            _WireIO(pool) if pool is not None else _RedisPyIO(conn_url, socket_connect_timeout_s)
        )
        # The pub/sub connection must not reconnect silently (that would drop notifications).
        self._sub_client = aioredis.Redis.from_url(
            conn_url,
            decode_responses=False,
            socket_connect_timeout=socket_connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._listener: _Listener | None = None
        self._sub_lock = asyncio.Lock()
        self._waiters: KeyedWaiters[bytes] = KeyedWaiters()
        """Futures of ``wait``, by the Redis key a put publishes."""
        self._closed = False
        self.wake_checks = 0
        """How many times ``wait`` re-examined its keys (tests use it to prove it does not spin)."""

    @property
    def url(self) -> str:
        return self._url

    @property
    def wire_pool(self) -> wire.WirePool | None:
        """The wire client's pool when the data path uses it (None on redis-py)."""
        return self._io.pool if isinstance(self._io, _WireIO) else None

    def _k(self, key: str) -> bytes:
        return (self._key_prefix + key).encode()

    # --- basic operations -------------------------------------------------------------------

    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        px = _px(ttl_s)
        try:
            await self._io.set_publish(
                self._k(key), encode_header(tensor), tensor_view(tensor), px, self._channel
            )
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: put {key!r} failed: {exc}") from exc

    async def _get_blob(self, key: str) -> Blob:
        try:
            blob = await self._io.get(self._k(key))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: get {key!r} failed: {exc}") from exc
        if blob is None:
            raise StoreKeyMissing(key)
        return blob

    async def get(self, key: str) -> torch.Tensor:
        blob = await self._get_blob(key)
        return tensor_from_blob(blob, decode_header(blob, key))

    async def get_bytes(self, key: str) -> bytes:
        blob = await self._get_blob(key)
        return bytes(memoryview(blob)[decode_header(blob, key).data_offset :])

    async def get_many(self, keys: Sequence[str]) -> list[torch.Tensor]:
        if not keys:
            return []
        try:
            blobs = await self._io.mget([self._k(k) for k in keys])
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: mget failed: {exc}") from exc
        missing = [k for k, b in zip(keys, blobs, strict=True) if b is None]
        if missing:
            raise StoreKeyMissing(missing)
        return [
            tensor_from_blob(b, decode_header(b, k))  # type: ignore[arg-type]
            for k, b in zip(keys, blobs, strict=True)
        ]

    async def exists(self, key: str) -> bool:
        try:
            (present,) = await self._io.exists_each([self._k(key)])
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: exists failed: {exc}") from exc
        return present

    async def touch(self, key: str, ttl_s: float | None) -> bool:
        # Redis alone keeps the expiry (the blob header's expires_ms stays 0 here, and get never
        # looks at it), so moving the key's TTL is the whole job.
        px = _px(ttl_s)
        try:
            return await self._io.touch(self._k(key), px)
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: touch {key!r} failed: {exc}") from exc

    async def delete(self, key: str) -> None:
        try:
            await self._io.delete(self._k(key))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: delete failed: {exc}") from exc

    # --- readiness ----------------------------------------------------------------------------

    async def _ensure_subscribed(self) -> _Listener:
        """Start a listener unless a live one exists; return it once Redis has confirmed the
        subscription (raises :class:`StoreUnavailable` if it stops before that)."""
        if self._closed:
            raise StoreError(f"redis store {self._url} is closed")
        async with self._sub_lock:
            listener = self._listener
            if listener is None or not listener.live:
                listener = _Listener(asyncio.get_running_loop().create_future())
                listener.task = asyncio.create_task(self._listen(listener))
                self._listener = listener
        await asyncio.shield(listener.confirmed)
        return listener

    async def _listen(self, listener: _Listener) -> None:
        pubsub = self._sub_client.pubsub()
        listener.pubsub = pubsub
        err: StoreError = StoreError(f"redis store {self._url} is closed")
        try:
            await pubsub.subscribe(self._channel)
            async for msg in pubsub.listen():
                kind = msg.get("type")
                if kind == b"subscribe" or kind == "subscribe":
                    if not listener.confirmed.done():
                        listener.confirmed.set_result(None)
                elif kind in (b"message", "message"):
                    self._waiters.wake(msg["data"])
            # listen() ends once nothing is subscribed: just as deaf as a lost connection.
            err = StoreUnavailable(f"redis store {self._url}: readiness subscription ended")
            log.warning("%s", err)
        except asyncio.CancelledError:
            raise  # close(): err says so
        except Exception as exc:
            err = StoreUnavailable(f"redis store {self._url}: readiness channel lost: {exc}")
            log.warning("%s", err)
        finally:
            self._stopped(listener, err)
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    def _stopped(self, listener: _Listener, err: StoreError) -> None:
        """Mark ``listener`` stopped and fail everything waiting on it, in one synchronous step
        (``wait`` relies on there being no await between the two)."""
        listener.stopped = True
        if not listener.confirmed.done():
            listener.confirmed.set_exception(err)
        self._waiters.wake_all(err)

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(dict.fromkeys(keys))
        if not pending:
            return
        try:
            listener = await asyncio.wait_for(self._ensure_subscribed(), max(timeout_s, 0.001))
        except TimeoutError:
            raise StoreTimeout(pending, timeout_s) from None
        # Register every key's future, then check once: a put landing in between is either seen
        # by the check or heard on the channel. A key heard was there when it was published
        # (SET and PUBLISH are one MULTI/EXEC), so no second EXISTS follows a notification: the
        # wake costs no round trip of its own. (Only its TTL, eviction or a restart removes it
        # before the reader's fetch, which then reports it missing.)
        names = {self._k(k): k for k in pending}

        def listener_live() -> None:
            # A listener that stopped before these futures were registered (since it confirmed)
            # failed only the waiters it knew of: nothing would wake these. One still live now
            # fails them itself when it stops.
            if not listener.live:
                raise StoreUnavailable(f"redis store {self._url}: readiness channel lost")

        async def missing(keys: list[bytes]) -> list[bytes]:
            self.wake_checks += 1
            try:
                present = await self._io.exists_each(keys)
            except _UNAVAILABLE as exc:
                raise StoreUnavailable(f"redis store {self._url}: wait failed: {exc}") from exc
            return [k for k, ok in zip(keys, present, strict=True) if not ok]

        await wait_present(
            self._waiters,
            list(names),
            max(0.0, deadline - loop.time()),
            missing=missing,
            timed_out=lambda left: StoreTimeout([names[k] for k in left], timeout_s),
            recheck=False,
            registered=listener_live,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        task = self._listener.task if self._listener is not None else None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._sub_client.aclose()
        await self._io.close()
