"""``redis+cluster://seed[,seed...]``: the embedding store on a Redis Cluster.

Embeddings and claim-checked inputs spread over the masters by key (their keys carry no hash
tag: each lands where its own hash puts it). Values use the blob layout of
:mod:`runtime.stores.base`, exactly as on ``redis://``. Reads go to masters (see
:mod:`runtime.redis.cluster`).

Data path: redis-py's asyncio ``RedisCluster`` keeps the slot map and is the way back whenever
something is off (``MOVED``/``ASK`` while a slot moves, a master gone, ``CLUSTERDOWN``): it
follows the redirect, refreshes its map and retries. Puts, gets, multi-gets and existence checks
go first, through that map, to the slot's master over the wire client of the ``redis://`` store
(:mod:`runtime.stores.redis_wire`: a value received straight into its own buffer and sent from
the tensor's memory), which costs a large value about a third of redis-py's time; a redirect or
a dead connection there falls back to redis-py for that call (``wire_io=False``: redis-py only).

Readiness: a put is ``SET key blob PX ttl`` and ``SPUBLISH <slot channel> key`` in one
``MULTI``/``EXEC`` on the key's master. The slot channel is ``{channel}:{<tag>}`` where the tag
hashes to the key's own slot (:func:`runtime.redis.cluster.slot_tags`), so the two commands are
one single-slot transaction and a reader who hears the key finds it. A waiter subscribes (sharded
pub/sub, :mod:`runtime.redis.sharded_pubsub`) to the channels of its keys' slots, confirmed, then
registers and checks ``EXISTS``, exactly as the ``redis://`` store does; subscriptions are kept
(at most one per slot) for the next wait. A subscription's connection that drops (a master died)
fails the waits that relied on it with :class:`StoreUnavailable` (transient: the consume loop
retries, and the retry subscribes on the slot's new master).

URL options: ``key_prefix`` (prepended to every key), ``channel`` (default
``epd:store:ready``), ``socket_timeout`` / ``socket_connect_timeout`` (seconds),
``max_connections`` (per master, default 64).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import redis.exceptions as rexc

from runtime.redis.cluster import ClusterURL, cluster_client, read_many, slot_of, slot_tags
from runtime.redis.sharded_pubsub import ShardedChannels
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
from schemas.keys import store_ready_slot_channel

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

UNAVAILABLE = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.ClusterError,
    rexc.TryAgainError,
    rexc.SlotNotCoveredError,
    OSError,
)
"""What a cluster answers while a master is down or a slot is moving: transient."""


REDIRECTS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "MASTERDOWN")
"""Error replies that say "not here, not now": the call goes the redis-py way instead."""


def _redirected(exc: rexc.ResponseError) -> bool:
    return str(exc).startswith(REDIRECTS)


class _WireRoutes:
    """Wire pools to the masters, found through the cluster client's slot map."""

    def __init__(self, client: Any, parsed: ClusterURL, connect_timeout_s: float) -> None:
        self.client = client
        self.parsed = parsed
        self.connect_timeout_s = connect_timeout_s
        options = dict(parsed.options)
        self.timeout_s = url_seconds(options, "socket_timeout")
        # Per master, as the cluster client's own pools are bound.
        self.max_connections = url_count(options, "max_connections", 64)
        self._pools: dict[str, wire.WirePool] = {}

    async def pool(self, rkey: bytes) -> wire.WirePool | None:
        """The pool of ``rkey``'s master by the client's map (None when it names none)."""
        await self.client.initialize()  # a no-op unless the map is stale or unknown
        node = self.client.get_node_from_key(rkey)
        if node is None:
            return None
        found = self._pools.get(node.name)
        if found is None:
            found = self._pools[node.name] = wire.WirePool(
                node.host,
                int(node.port),
                0,
                username=self.parsed.username,
                password=self.parsed.password,
                connect_timeout_s=self.connect_timeout_s,
                timeout_s=self.timeout_s,
                max_connections=self.max_connections,
            )
        return found

    def close(self) -> None:
        for p in self._pools.values():
            p.close()
        self._pools.clear()


def _px(ttl_s: float | None) -> int | None:
    expiry_ms(ttl_s)  # validates the TTL; Redis does the expiring itself
    return None if ttl_s is None else max(1, int(ttl_s * 1000))


class RedisClusterStore(EmbeddingStore):
    """Embedding store on a Redis Cluster; see the module docstring."""

    def __init__(
        self, url: str, *, socket_connect_timeout_s: float = 5.0, wire_io: bool = True
    ) -> None:
        """Open a handle on ``url`` (no I/O yet). ``wire_io=False``: redis-py for everything
        (tests and the benchmark compare the two)."""
        parsed = ClusterURL.parse(url)
        self._parsed = parsed
        self._url = parsed.name
        self._key_prefix = parsed.option("key_prefix", "") or ""
        self._channel = parsed.option("channel", "epd:store:ready") or "epd:store:ready"
        self._client = cluster_client(
            parsed,
            max_connections=url_count(dict(parsed.options), "max_connections", 64),
            socket_connect_timeout=socket_connect_timeout_s,
            decode_responses=False,
        )
        self._routes = (
            _WireRoutes(self._client, parsed, socket_connect_timeout_s) if wire_io else None
        )
        self._subs = ShardedChannels(
            self._client,
            self._woken,
            self._deaf,
            connect_timeout_s=socket_connect_timeout_s,
        )
        self._waiters: KeyedWaiters[bytes] = KeyedWaiters()
        """Futures of ``wait``, by the Redis key a put announces."""
        # Computed (once per process) when the store is opened, not on a request's path.
        self._tags = slot_tags()
        self._closed = False
        self.wake_checks = 0
        """How many times ``wait`` re-examined its keys (tests use it to prove it does not spin)."""

    @property
    def url(self) -> str:
        """The cluster's normalised name (all seeds), whatever order they were given in."""
        return self._url

    @property
    def client(self) -> Any:
        """The ``RedisCluster`` client of the data path."""
        return self._client

    def _k(self, key: str) -> bytes:
        return (self._key_prefix + key).encode()

    def _ready_channel(self, rkey: bytes) -> bytes:
        """The readiness channel of ``rkey``'s slot."""
        return store_ready_slot_channel(self._channel, self._tags[slot_of(rkey)]).encode()

    async def _by_wire(self, rkey: bytes, op: Any) -> tuple[bool, Any]:
        """``(True, op(pool))`` over the wire to ``rkey``'s master, or ``(False, None)`` when
        the caller should go the redis-py way (no wire path, a redirect, a dead connection)."""
        if self._routes is None:
            return False, None
        try:
            pool = await self._routes.pool(rkey)
            if pool is None:
                return False, None
            return True, await op(pool)
        except rexc.ResponseError as exc:
            if _redirected(exc):
                return False, None
            raise
        except (
            rexc.ConnectionError,
            rexc.TimeoutError,
            rexc.SlotNotCoveredError,
            OSError,
            TimeoutError,
        ):
            return False, None  # redis-py finds the slot's master now, or says it cannot

    def _unavailable(self, what: str, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(f"redis cluster store {self._url}: {what} failed: {exc}")

    # --- basic operations -------------------------------------------------------------------

    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        px = _px(ttl_s)
        rkey = self._k(key)
        header, data, channel = (
            encode_header(tensor),
            tensor_view(tensor),
            self._ready_channel(rkey),
        )

        async def by_wire(pool: wire.WirePool) -> None:
            await wire.set_and_publish(pool, rkey, (header, data), px, channel, b"SPUBLISH")

        try:
            done, _ = await self._by_wire(rkey, by_wire)
        except UNAVAILABLE as exc:
            raise self._unavailable(f"put {key!r}", exc) from exc
        if done:
            return
        blob = b"".join((header, data))  # redis-py sends one argument from one buffer
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                if px is None:
                    pipe.set(rkey, blob)
                else:
                    pipe.set(rkey, blob, px=px)
                pipe.spublish(channel, rkey)
                await pipe.execute()
        except UNAVAILABLE as exc:
            raise self._unavailable(f"put {key!r}", exc) from exc

    async def _get_blob(self, key: str) -> Blob:
        rkey = self._k(key)
        try:
            done, blob = await self._by_wire(rkey, lambda pool: wire.get(pool, rkey))
            if not done:
                blob = await self._client.get(rkey)
        except UNAVAILABLE as exc:
            raise self._unavailable(f"get {key!r}", exc) from exc
        if blob is None:
            raise StoreKeyMissing(key)
        assert not isinstance(blob, str)  # decode_responses=False
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
            blobs = await self._read_many([self._k(k) for k in keys])
        except UNAVAILABLE as exc:
            raise self._unavailable("mget", exc) from exc
        missing = [k for k, b in zip(keys, blobs, strict=True) if b is None]
        if missing:
            raise StoreKeyMissing(missing)
        present = [b for b in blobs if b is not None]
        return [
            tensor_from_blob(b, decode_header(b, k)) for k, b in zip(keys, present, strict=True)
        ]

    async def _read_many(self, rkeys: list[bytes]) -> list[Blob | None]:
        """MGET by slot (a multi-key command must stay in one slot), over the wire where it
        can go, all slots at once."""
        by_slot: dict[int, list[int]] = {}
        for i, k in enumerate(rkeys):
            by_slot.setdefault(slot_of(k), []).append(i)

        async def one(group: list[int]) -> list[Any]:
            keys = [rkeys[i] for i in group]
            done, values = await self._by_wire(keys[0], lambda pool: wire.mget(pool, keys))
            return values if done else await read_many(self._client, keys)

        groups = list(by_slot.values())
        out: list[Blob | None] = [None] * len(rkeys)
        for group, values in zip(groups, await asyncio.gather(*map(one, groups)), strict=True):
            for i, v in zip(group, values, strict=True):
                out[i] = v
        return out

    async def _exists_each(self, rkeys: Sequence[bytes]) -> list[bool]:
        async def one(rkey: bytes) -> bool:
            done, found = await self._by_wire(rkey, lambda pool: wire.exists_each(pool, [rkey]))
            return bool(found[0]) if done else bool(await self._client.exists(rkey))

        return list(await asyncio.gather(*map(one, rkeys)))

    async def exists(self, key: str) -> bool:
        try:
            (present,) = await self._exists_each([self._k(key)])
        except UNAVAILABLE as exc:
            raise self._unavailable("exists", exc) from exc
        return present

    async def touch(self, key: str, ttl_s: float | None) -> bool:
        px = _px(ttl_s)
        rkey = self._k(key)
        try:
            if px is not None:
                return bool(await self._client.pexpire(rkey, px))
            await self._client.persist(rkey)
            return bool(await self._client.exists(rkey))
        except UNAVAILABLE as exc:
            raise self._unavailable(f"touch {key!r}", exc) from exc

    async def delete(self, key: str) -> None:
        try:
            await self._client.delete(self._k(key))
        except UNAVAILABLE as exc:
            raise self._unavailable("delete", exc) from exc

    # --- readiness ----------------------------------------------------------------------------

    def _woken(self, channel: bytes, data: bytes) -> None:
        self._waiters.wake(data)

    def _deaf(self, channels: frozenset[bytes]) -> None:
        """Fail every wait on a key whose slot channel went deaf (one synchronous step)."""
        err = StoreUnavailable(f"redis cluster store {self._url}: readiness channel lost")
        for rkey in self._waiters.keys():
            if self._ready_channel(rkey) in channels:
                self._waiters.wake(rkey, err)

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = list(dict.fromkeys(keys))
        if not pending:
            return
        if self._closed:
            raise StoreError(f"redis cluster store {self._url} is closed")
        rkeys = {k: self._k(k) for k in pending}
        channels = {self._ready_channel(r) for r in rkeys.values()}
        try:
            left = max(deadline - loop.time(), 0.001)
            await asyncio.wait_for(self._subs.subscribe(channels), left)
        except TimeoutError:
            # Subscribing took the whole wait (first connections to the masters): what is
            # missing is what is not there now.
            try:
                there = await self._exists_each([rkeys[k] for k in pending])
            except UNAVAILABLE as exc:
                raise self._unavailable("wait", exc) from exc
            missing_now = [k for k, ok in zip(pending, there, strict=True) if not ok]
            if missing_now:
                raise StoreTimeout(missing_now, timeout_s) from None
            return
        except UNAVAILABLE as exc:
            raise self._unavailable("wait (subscribe)", exc) from exc
        names = {rkeys[k]: k for k in pending}

        def channels_live() -> None:
            # Registered after the subscriptions were confirmed, checked with no await between:
            # a channel that went deaf since then failed only the futures it knew of.
            if not all(self._subs.subscribed(c) for c in channels):
                raise StoreUnavailable(f"redis cluster store {self._url}: readiness channel lost")

        async def missing(names_left: list[bytes]) -> list[bytes]:
            self.wake_checks += 1
            try:
                present = await self._exists_each(names_left)
            except UNAVAILABLE as exc:
                raise self._unavailable("wait", exc) from exc
            return [k for k, ok in zip(names_left, present, strict=True) if not ok]

        # A wake is the write itself (SET and SPUBLISH in one MULTI): no second look.
        await wait_present(
            self._waiters,
            list(names),
            max(0.0, deadline - loop.time()),
            missing=missing,
            timed_out=lambda left: StoreTimeout([names[k] for k in left], timeout_s),
            recheck=False,
            registered=channels_live,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._subs.close()
        if self._routes is not None:
            self._routes.close()
        with contextlib.suppress(Exception):
            await self._client.aclose()
