"""Status-change notifications: a pub/sub listener that survives reconnects, and the waiters
that long-polls and event streams sleep on (woken by a message, never a polling loop).

On one Redis every change is announced on one channel (``RedisKeys.status_notify``) that each
process subscribes to once. On a Redis Cluster each request's changes go to its own sharded
channel (``RedisKeys.status_changes``, in the request's slot, published by the record's own
update script), and a process subscribes to a request's channel only while someone waits on
that request: a change costs its shard alone, not every node (see
:mod:`runtime.sharded_pubsub`). Cancels stay on one classic channel (:mod:`runtime.status.cancel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from runtime.redis_cluster import RedisClient, node_client
from runtime.sharded_pubsub import ShardedChannels

if TYPE_CHECKING:
    from runtime.status.store import StatusStore
    from schemas.status_record import StatusRecord

log = logging.getLogger(__name__)


class ChannelListener:
    """One pub/sub subscription, handing each message to ``on_message``; reconnects on errors.

    ``on_gap`` runs after a reconnect (messages may have been missed while disconnected), so
    waiters can re-read state instead of sleeping until their timeout. On a Redis Cluster the
    subscription is made on one node picked at random (a classic channel's messages reach every
    node), and a reconnect picks again, so a dead master is left behind.
    """

    def __init__(
        self,
        client: RedisClient,
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
            node: aioredis.Redis | None = None
            pubsub: Any = None
            try:
                node = await self._node_client()
                pubsub = (node or self.client).pubsub(ignore_subscribe_messages=True)
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
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        await pubsub.aclose()
                if node is not None:
                    with contextlib.suppress(Exception):
                        await node.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _node_client(self) -> aioredis.Redis | None:
        """On a cluster, a client of one of its nodes (None on a single Redis)."""
        if not isinstance(self.client, RedisCluster):
            return None
        await self.client.initialize()  # the nodes are known once it has asked a seed
        return node_client(self.client, random.choice(self.client.get_nodes()))


def forget(waiters: dict[str, set[Any]], request_id: str, waiter: Any) -> None:
    """Drop one waiter of ``request_id``, and the request's entry once it has none left."""
    left = waiters.get(request_id)
    if left is not None:
        left.discard(waiter)
        if not left:
            del waiters[request_id]


class StatusNotifier:
    """Wakes waiters of a request when its status changes (see the module docstring)."""

    RESUBSCRIBE_MAX_S = 2.0

    def __init__(self, store: StatusStore) -> None:
        self.store = store
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self.listener: ChannelListener | None = None
        self._sharded: ShardedChannels | None = None
        self._deaf: set[str] = set()
        self._healing: asyncio.Task[None] | None = None
        if isinstance(store.client, RedisCluster):
            self._sharded = ShardedChannels(store.client, self._heard, self._lost)
        else:
            self.listener = ChannelListener(
                store.client, store.keys.status_notify, self._wake, on_gap=self._wake_all
            )

    @property
    def healthy(self) -> bool:
        if self.listener is not None:
            return self.listener.healthy
        return not self._deaf

    async def start(self) -> None:
        if self.listener is not None:
            await self.listener.start()
        elif self._sharded is not None:
            await self._sharded.cluster.initialize()

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
        if self._healing is not None:
            self._healing.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._healing
        if self._sharded is not None:
            await self._sharded.close()

    def _wake(self, request_id: str) -> None:
        for ev in self._waiters.get(request_id, ()):
            ev.set()

    def _wake_all(self) -> None:
        for evs in self._waiters.values():
            for ev in evs:
                ev.set()

    # ------------------------------------------------ cluster: one channel per watched request

    def _channel(self, request_id: str) -> bytes:
        return self.store.keys.status_changes(request_id).encode()

    def _heard(self, channel: bytes, data: bytes) -> None:
        self._wake(data.decode())

    def _lost(self, channels: frozenset[bytes]) -> None:
        """Channels went deaf (their master died): wake their waiters to re-read, and
        subscribe them again where their slots live now."""
        for rid in list(self._waiters):
            if self._channel(rid) in channels:
                self._deaf.add(rid)
                self._wake(rid)
        if self._deaf and (self._healing is None or self._healing.done()):
            self._healing = asyncio.get_running_loop().create_task(self._heal())

    async def _heal(self) -> None:
        delay = 0.1
        while self._deaf and self._sharded is not None:
            self._deaf.intersection_update(self._waiters)  # nobody waits on the others now
            rids = list(self._deaf)
            try:
                await self._sharded.subscribe(self._channel(r) for r in rids)
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("status channels not back yet (%r); retrying", exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.RESUBSCRIBE_MAX_S)
                continue
            self._deaf.difference_update(rids)
            for rid in rids:
                self._wake(rid)  # a change may have come while they were deaf

    async def _follow(self, request_id: str) -> None:
        if self._sharded is None:
            return
        try:
            await self._sharded.subscribe([self._channel(request_id)])
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("cannot follow %s yet (%r)", request_id, exc)
            self._lost(frozenset({self._channel(request_id)}))

    async def _unfollow(self, request_id: str) -> None:
        if self._sharded is not None and request_id not in self._waiters:
            self._deaf.discard(request_id)
            await self._sharded.unsubscribe([self._channel(request_id)])

    # ----------------------------------------------------------------------------- waiting

    @contextlib.asynccontextmanager
    async def watch(self, request_id: str) -> AsyncIterator[asyncio.Event]:
        """An event set on the next change of ``request_id``; register *before* reading the
        record, so a change between the read and the wait is never missed. Clear it to re-arm.
        On a cluster it is entered once the request's channel is subscribed."""
        ev = asyncio.Event()
        self._waiters.setdefault(request_id, set()).add(ev)
        try:
            await self._follow(request_id)  # every watcher: a second one waits for the first's
            yield ev
        finally:
            forget(self._waiters, request_id, ev)
            await self._unfollow(request_id)

    async def wait_change(
        self, request_id: str, status: str | None, timeout_s: float
    ) -> StatusRecord | None:
        """The record once its status differs from ``status`` or is terminal, or as it is
        when ``timeout_s`` runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self.watch(request_id) as changed:
            while True:
                changed.clear()
                rec = await self.store.get(request_id)
                if rec is None or rec.status != status or rec.terminal:
                    return rec
                left = deadline - loop.time()
                if left <= 0:
                    return rec
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
