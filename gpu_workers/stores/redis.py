"""``redis://host:port/db``: the multi-node embedding store.

Each value is one blob (header + raw little-endian bytes, see :mod:`gpu_workers.stores.base`),
written with ``SET key blob PX ttl`` and ``PUBLISH <channel> key`` in one MULTI/EXEC, so a reader
that hears the notification always finds the value.

Readiness: one pub/sub connection per store handle subscribes to a namespace channel and routes
each published key to the futures waiting on it. ``wait`` makes sure that subscription is
confirmed, registers its futures, and only then checks ``EXISTS``; a put landing in between is
therefore either seen by the check or heard on the channel, never lost. Pub/sub is global across
Redis DB numbers, so the default channel names the DB. The pub/sub connection does not retry: if it
drops, messages published meanwhile would be lost, so every pending ``wait`` fails with
:class:`StoreUnavailable` (transient; the consume loop retries) and the next ``wait`` resubscribes.

URL query parameters understood here (others go to redis-py): ``key_prefix`` (prepended to every
key, e.g. a tenant or test namespace) and ``channel`` (the readiness channel name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
import redis.exceptions as rexc
import torch
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from gpu_workers.stores.base import (
    EmbeddingStore,
    StoreError,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
    decode_header,
    encode_header,
    expiry_ms,
    tensor_from_blob,
    tensor_view,
)

log = logging.getLogger(__name__)

_OWN_PARAMS = ("key_prefix", "channel")
_UNAVAILABLE = (rexc.ConnectionError, rexc.TimeoutError, OSError)


class RedisStore(EmbeddingStore):
    """Embedding store on a Redis server; see the module docstring."""

    def __init__(self, url: str, *, socket_connect_timeout_s: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError(f"not a redis:// URL: {url!r}")
        query = dict(parse_qsl(parts.query))
        own = {k: query.pop(k) for k in _OWN_PARAMS if k in query}
        self._url = url
        self._key_prefix = own.get("key_prefix", "")
        conn_url = urlunsplit(parts._replace(query=urlencode(query)))
        db = (parts.path or "/0").strip("/") or "0"
        self._channel = own.get("channel", f"epd:store:ready:{db}").encode()
        self._pool = aioredis.ConnectionPool.from_url(
            conn_url, decode_responses=False, socket_connect_timeout=socket_connect_timeout_s
        )
        self._client = aioredis.Redis(connection_pool=self._pool)
        # The pub/sub connection must not reconnect silently (that would drop notifications).
        self._sub_client = aioredis.Redis.from_url(
            conn_url,
            decode_responses=False,
            socket_connect_timeout=socket_connect_timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._pubsub: Any = None
        self._listener: asyncio.Task[None] | None = None
        self._subscribed: asyncio.Future[None] | None = None
        self._sub_lock = asyncio.Lock()
        self._waiters: dict[bytes, set[asyncio.Future[None]]] = {}
        self._closed = False
        self.wake_checks = 0
        """How many times ``wait`` re-examined its keys (tests use it to prove it does not spin)."""

    @property
    def url(self) -> str:
        return self._url

    def _k(self, key: str) -> bytes:
        return (self._key_prefix + key).encode()

    # --- basic operations -------------------------------------------------------------------

    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        expiry_ms(ttl_s)  # validates the TTL; Redis does the expiring itself
        blob = b"".join((encode_header(tensor), tensor_view(tensor)))
        k = self._k(key)
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                if ttl_s is None:
                    pipe.set(k, blob)
                else:
                    pipe.set(k, blob, px=max(1, int(ttl_s * 1000)))
                pipe.publish(self._channel, k)
                await pipe.execute()
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: put {key!r} failed: {exc}") from exc

    async def _get_blob(self, key: str) -> bytes:
        try:
            blob = await self._client.get(self._k(key))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: get {key!r} failed: {exc}") from exc
        if blob is None:
            raise StoreKeyMissing(key)
        assert isinstance(blob, bytes)  # decode_responses=False
        return blob

    async def get(self, key: str) -> torch.Tensor:
        blob = await self._get_blob(key)
        return tensor_from_blob(blob, decode_header(blob, key))

    async def get_bytes(self, key: str) -> bytes:
        blob = await self._get_blob(key)
        return blob[decode_header(blob, key).data_offset :]

    async def get_many(self, keys: Sequence[str]) -> list[torch.Tensor]:
        if not keys:
            return []
        try:
            blobs = await self._client.mget([self._k(k) for k in keys])
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
            return bool(await self._client.exists(self._k(key)))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: exists failed: {exc}") from exc

    async def delete(self, key: str) -> None:
        try:
            await self._client.delete(self._k(key))
        except _UNAVAILABLE as exc:
            raise StoreUnavailable(f"redis store {self._url}: delete failed: {exc}") from exc

    # --- readiness ----------------------------------------------------------------------------

    async def _ensure_subscribed(self) -> None:
        """Start the listener (once) and return when Redis has confirmed the subscription."""
        if self._closed:
            raise StoreError(f"redis store {self._url} is closed")
        async with self._sub_lock:
            if self._listener is None or self._listener.done():
                self._subscribed = asyncio.get_running_loop().create_future()
                self._listener = asyncio.create_task(self._listen(self._subscribed))
            subscribed = self._subscribed
        assert subscribed is not None
        await asyncio.shield(subscribed)

    async def _listen(self, subscribed: asyncio.Future[None]) -> None:
        pubsub = self._sub_client.pubsub()
        self._pubsub = pubsub
        try:
            await pubsub.subscribe(self._channel)
            async for msg in pubsub.listen():
                kind = msg.get("type")
                if kind == b"subscribe" or kind == "subscribe":
                    if not subscribed.done():
                        subscribed.set_result(None)
                elif kind in (b"message", "message"):
                    for fut in self._waiters.get(msg["data"], ()):
                        if not fut.done():
                            fut.set_result(None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            err = StoreUnavailable(f"redis store {self._url}: readiness channel lost: {exc}")
            log.warning("%s", err)
            if not subscribed.done():
                subscribed.set_exception(err)
            for futs in self._waiters.values():
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(err)
        finally:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(dict.fromkeys(keys))
        if not pending:
            return
        try:
            await asyncio.wait_for(self._ensure_subscribed(), max(timeout_s, 0.001))
        except TimeoutError:
            raise StoreTimeout(pending, timeout_s) from None
        while True:
            futs = {k: loop.create_future() for k in pending}
            for k, fut in futs.items():
                self._waiters.setdefault(self._k(k), set()).add(fut)
            try:
                self.wake_checks += 1
                try:
                    async with self._client.pipeline(transaction=False) as pipe:
                        for k in pending:
                            pipe.exists(self._k(k))
                        present = await pipe.execute()
                except _UNAVAILABLE as exc:
                    raise StoreUnavailable(f"redis store {self._url}: wait failed: {exc}") from exc
                pending = [k for k, ok in zip(pending, present, strict=True) if not ok]
                if not pending:
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise StoreTimeout(pending, timeout_s)
                done, _ = await asyncio.wait(
                    [futs[k] for k in pending],
                    timeout=remaining,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for fut in done:
                    failure = fut.exception()
                    if failure is not None:
                        raise failure
            finally:
                for k, fut in futs.items():
                    if not fut.done():
                        fut.cancel()
                    elif not fut.cancelled():
                        fut.exception()  # mark a listener failure as retrieved
                    waiting = self._waiters.get(self._k(k))
                    if waiting is not None:
                        waiting.discard(fut)
                        if not waiting:
                            del self._waiters[self._k(k)]

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
        await self._sub_client.aclose()
        await self._client.aclose()
        await self._pool.disconnect()
