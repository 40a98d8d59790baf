"""A pub/sub subscription that survives reconnects (:class:`ChannelListener`), and the waiter
bookkeeping beside it: what status notifications, cancels and token streams listen with."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from runtime.redis.cluster import RedisClient, node_client

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


class RequestEvents:
    """The events of the readers waiting on each request: set when the request changes (a
    reader clears its own to re-arm). What status notifications and token streams wait with."""

    def __init__(self) -> None:
        self._by_request: dict[str, set[asyncio.Event]] = {}

    def add(self, request_id: str) -> asyncio.Event:
        """A new event for one reader of ``request_id``; :meth:`forget` it when done."""
        ev = asyncio.Event()
        self._by_request.setdefault(request_id, set()).add(ev)
        return ev

    def forget(self, request_id: str, ev: asyncio.Event) -> None:
        """Drop one reader's event, and the request's entry once it has none left."""
        left = self._by_request.get(request_id)
        if left is not None:
            left.discard(ev)
            if not left:
                del self._by_request[request_id]

    def wake(self, request_id: str) -> None:
        """Set the events of ``request_id``'s readers."""
        for ev in self._by_request.get(request_id, ()):
            ev.set()

    def wake_all(self) -> None:
        """Set every reader's event (messages may have been missed: all read again)."""
        for evs in self._by_request.values():
            for ev in evs:
                ev.set()

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def requests(self) -> list[str]:
        """The requests someone waits on now."""
        return list(self._by_request)
