"""Sharded pub/sub on a Redis Cluster: ``SSUBSCRIBE`` to channels where their slots live.

Why sharded (Redis 7's ``SPUBLISH``/``SSUBSCRIBE``) and not the classic channels: a classic
``PUBLISH`` on a cluster is copied to every node over the cluster bus, so each announcement costs
the whole cluster, and the bus carries every node's traffic; a sharded message stays on the shard
that owns the channel's slot (its master and replicas). A channel placed in the slot of the keys
it announces (a request's hash tag; the store's per-slot tag) can also be published by the same
script or transaction that writes the key, so a reader who hears it finds the write.

:class:`ShardedChannels` keeps one connection per master it subscribes on and confirms each
subscription before returning, so a caller can subscribe, then look, then wait, and miss
nothing. The connections do not reconnect silently: when one drops (the master died, or the
slot moved and the server unsubscribed us), ``on_lost`` hears which channels went deaf at once,
so waiters re-read state or fail instead of sleeping through a change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from runtime.redis.cluster import node_client

log = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 5.0


def _retrieve(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclass(eq=False)
class _Link:
    """One master's subscription connection."""

    name: str
    client: aioredis.Redis
    pubsub: Any
    channels: set[bytes] = field(default_factory=set)
    """Confirmed subscriptions."""
    pending: dict[bytes, asyncio.Future[None]] = field(default_factory=dict)
    leaving: Counter[bytes] = field(default_factory=Counter)
    """Our unsubscribes not confirmed yet (such a ``sunsubscribe`` is ours, not the server's)."""
    task: asyncio.Task[None] | None = None
    dead: bool = False
    sending: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One (un)subscribe command at a time: two at once would each open a connection, and the
    replies of the one not kept would never be read."""


class ShardedChannels:
    """``SSUBSCRIBE``\\ s across a cluster's masters; messages go to ``on_message(channel,
    data)``, channels that went deaf to ``on_lost(channels)`` (see the module docstring)."""

    def __init__(
        self,
        cluster: RedisCluster,
        on_message: Callable[[bytes, bytes], None],
        on_lost: Callable[[frozenset[bytes]], None],
        *,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.cluster = cluster
        self.on_message = on_message
        self.on_lost = on_lost
        self.connect_timeout_s = connect_timeout_s
        self._links: dict[str, _Link] = {}
        self._where: dict[bytes, _Link] = {}
        self._closed = False

    def subscribed(self, channel: bytes) -> bool:
        """Whether ``channel`` is subscribed on a live connection now."""
        link = self._where.get(channel)
        return link is not None and not link.dead

    async def subscribe(self, channels: Iterable[bytes]) -> None:
        """Subscribe to ``channels`` (each on its slot's master); returns once every one is
        confirmed. Raises redis-py's ``ConnectionError`` when a master cannot be reached."""
        wanted = [c for c in dict.fromkeys(channels) if not self.subscribed(c)]
        if wanted:
            await asyncio.gather(*(self._subscribe_one(c) for c in wanted))

    async def unsubscribe(self, channels: Iterable[bytes]) -> None:
        """Stop listening to ``channels`` (best effort: a dead connection heard nothing)."""
        for channel in channels:
            link = self._where.pop(channel, None)
            if link is None or link.dead:
                continue
            link.channels.discard(channel)
            link.leaving[channel] += 1
            with contextlib.suppress(RedisError, OSError):
                async with link.sending:
                    await link.pubsub.sunsubscribe(channel)

    async def close(self) -> None:
        """Close every connection (no ``on_lost`` for them)."""
        self._closed = True
        for link in list(self._links.values()):
            await self._drop(link, notify=False)

    async def _subscribe_one(self, channel: bytes) -> None:
        try:
            await self._try_subscribe(channel)
        except (RedisConnectionError, OSError, TimeoutError):
            # The slot map may name a master that is gone: a keyed command through the cluster
            # client follows it to the slot's owner now (redis-py refreshes its map on the
            # way), then the subscription is tried once more.
            await self.cluster.exists(channel)
            await self._try_subscribe(channel)

    async def _try_subscribe(self, channel: bytes) -> None:
        if self._closed:
            raise RedisConnectionError("sharded subscriptions are closed")
        await self.cluster.initialize()
        # Bytes are hashed as they are (the annotation says str; the encoder takes both).
        node = self.cluster.get_node_from_key(cast("str", channel))
        if node is None:
            raise RedisConnectionError(f"no master serves the slot of {channel!r}")
        link = self._links.get(node.name)
        if link is None or link.dead:
            link = self._open(node)
        fut = link.pending.get(channel)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_retrieve)  # a failure nobody awaited is not an error
            link.pending[channel] = fut
            try:
                async with link.sending:
                    await link.pubsub.ssubscribe(channel)
            except BaseException as exc:
                link.pending.pop(channel, None)
                if not fut.done():
                    fut.set_exception(RedisConnectionError(f"ssubscribe failed: {exc!r}"))
                await self._drop(link, notify=True)
                raise
            if link.task is None:
                link.task = asyncio.create_task(self._listen(link), name=f"ssub:{link.name}")
        await asyncio.wait_for(asyncio.shield(fut), SUBSCRIBE_TIMEOUT_S)

    def _open(self, node: ClusterNode) -> _Link:
        client = node_client(self.cluster, node, socket_connect_timeout=self.connect_timeout_s)
        link = _Link(node.name, client, client.pubsub())
        self._links[node.name] = link
        return link

    async def _listen(self, link: _Link) -> None:
        try:
            while True:
                msg = await link.pubsub.get_message(timeout=None)
                if msg is None:
                    continue
                kind = msg.get("type")
                kind = kind.decode() if isinstance(kind, bytes) else kind
                channel = msg.get("channel")
                if kind == "smessage":
                    self.on_message(channel, msg["data"])
                elif kind == "ssubscribe":
                    fut = link.pending.pop(channel, None)
                    link.channels.add(channel)
                    self._where[channel] = link
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                elif kind == "sunsubscribe":
                    if link.leaving[channel] > 0:
                        link.leaving[channel] -= 1
                        if not link.leaving[channel]:
                            del link.leaving[channel]
                    else:  # the server's: the slot moved away from this node
                        link.channels.discard(channel)
                        if self._where.get(channel) is link:
                            del self._where[channel]
                        self.on_lost(frozenset({channel}))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self._closed:
                log.warning("sharded pub/sub on %s lost: %r", link.name, exc)
        finally:
            if not link.dead:
                await self._drop(link, notify=not self._closed)

    async def _drop(self, link: _Link, *, notify: bool) -> None:
        """Forget ``link`` and tell ``on_lost`` what it held, in one synchronous step."""
        if link.dead:
            return
        link.dead = True
        if self._links.get(link.name) is link:
            del self._links[link.name]
        lost = frozenset(link.channels) | frozenset(link.pending)
        for channel in lost:
            if self._where.get(channel) is link:
                del self._where[channel]
        for fut in link.pending.values():
            if not fut.done():
                fut.set_exception(RedisConnectionError(f"sharded pub/sub on {link.name} lost"))
        link.pending.clear()
        link.channels.clear()
        if notify and lost:
            self.on_lost(lost)
        task = link.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await link.pubsub.aclose()
        with contextlib.suppress(Exception):
            await link.client.aclose()
