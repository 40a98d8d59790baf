"""Status-change notifications: the waiters that long-polls and event streams sleep on (woken
by a message, never a polling loop; the listener is :mod:`runtime.status.listener`).

On one Redis every change is announced on one channel (``RedisKeys.status_notify``) that each
process subscribes to once. On a Redis Cluster each request's changes go to its own sharded
channel (``RedisKeys.status_changes``, in the request's slot, published by the record's own
update script), and a process subscribes to a request's channel only while someone waits on
that request: a change costs its shard alone, not every node (see
:mod:`runtime.redis.sharded_pubsub`). Cancels stay on one classic channel
(:mod:`runtime.status.cancel`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from runtime.redis.sharded_pubsub import ShardedChannels
from runtime.status.listener import ChannelListener, RequestEvents

if TYPE_CHECKING:
    from runtime.status.store import StatusStore
    from schemas.status_record import StatusRecord

log = logging.getLogger(__name__)


class StatusNotifier:
    """Wakes waiters of a request when its status changes (see the module docstring)."""

    RESUBSCRIBE_MAX_S = 2.0

    def __init__(self, store: StatusStore) -> None:
        self.store = store
        self._waiters = RequestEvents()
        self.listener: ChannelListener | None = None
        self._sharded: ShardedChannels | None = None
        self._deaf: set[str] = set()
        self._healing: asyncio.Task[None] | None = None
        if isinstance(store.client, RedisCluster):
            self._sharded = ShardedChannels(store.client, self._heard, self._lost)
        else:
            w = self._waiters
            self.listener = ChannelListener(
                store.client, store.keys.status_notify, w.wake, on_gap=w.wake_all
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

    # ------------------------------------------------ cluster: one channel per watched request

    def _channel(self, request_id: str) -> bytes:
        return self.store.keys.status_changes(request_id).encode()

    def _heard(self, channel: bytes, data: bytes) -> None:
        self._waiters.wake(data.decode())

    def _lost(self, channels: frozenset[bytes]) -> None:
        """Channels went deaf (their master died): wake their waiters to re-read, and
        subscribe them again where their slots live now."""
        for rid in self._waiters.requests():
            if self._channel(rid) in channels:
                self._deaf.add(rid)
                self._waiters.wake(rid)
        if self._deaf and (self._healing is None or self._healing.done()):
            self._healing = asyncio.get_running_loop().create_task(self._heal())

    async def _heal(self) -> None:
        delay = 0.1
        while self._deaf and self._sharded is not None:
            # Nobody waits on the others now.
            self._deaf.intersection_update(self._waiters.requests())
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
                self._waiters.wake(rid)  # a change may have come while they were deaf

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
        ev = self._waiters.add(request_id)
        try:
            await self._follow(request_id)  # every watcher: a second one waits for the first's
            yield ev
        finally:
            self._waiters.forget(request_id, ev)
            await self._unfollow(request_id)

    async def wait_change(
        self,
        request_id: str,
        status: str | None,
        timeout_s: float,
        *,
        until_done: bool = False,
        check: Callable[[StatusRecord | None], object] | None = None,
    ) -> StatusRecord | None:
        """The record once its status differs from ``status`` (None: from the status the
        first read finds; with ``until_done``: once it is terminal, whatever it passes on the
        way) or is terminal, or as it is when ``timeout_s`` runs out.

        ``check`` judges the first read and may raise (a route's ownership check): a caller
        that would read the record only to check it leaves that read to this one, which is
        made once the watch is on."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        first = True
        async with self.watch(request_id) as changed:
            while True:
                changed.clear()
                rec = await self.store.get(request_id)
                if first:
                    first = False
                    if check is not None:
                        check(rec)
                    if status is None and rec is not None:
                        status = rec.status
                if rec is None or rec.terminal or (rec.status != status and not until_done):
                    return rec
                left = deadline - loop.time()
                if left <= 0:
                    return rec
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), left)
