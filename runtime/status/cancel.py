"""Cancellation: the flag and announcement the API writes, and the watch workers ask.

The API marks a request cancelled (``RedisKeys.cancel`` + a message on
``RedisKeys.cancel_channel``); workers ask a :class:`CancelWatch` before compute and between
decode steps. On a Redis Cluster the flag sits in the request's slot and the announcement stays
a classic (cluster-wide) channel: every worker must hear every cancel without knowing which
requests are coming to it, cancels are rare, and the flag, not the message, is authoritative.
"""

from __future__ import annotations

from collections import OrderedDict

from redis.exceptions import RedisError

from runtime.redis.cluster import RedisClient, is_cluster_client
from runtime.redis.waiters import KeyedWaiters
from runtime.status.listener import ChannelListener
from schemas.keys import RedisKeys


async def announce_cancel(
    client: RedisClient, keys: RedisKeys, request_id: str, *, ttl_s: int
) -> None:
    """Set the request's cancel flag (what workers check) and tell running workers."""
    await client.set(keys.cancel(request_id), b"1", ex=ttl_s)
    await client.publish(keys.cancel_channel, request_id)


class CancelWatch:
    """What workers ask before compute and between decode steps: is this request cancelled?

    ``is_cancelled`` reads the flag in Redis (authoritative, one round trip); ``cancelled_now``
    is a lock-free membership test of the ids announced on the cancel channel since start-up,
    cheap enough for the decode loop's compute thread.
    """

    def __init__(self, client: RedisClient, prefix: str, *, remember: int = 10000) -> None:
        self.client = client
        self.keys = RedisKeys(prefix, cluster=is_cluster_client(client))
        self.remember = remember
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._waiters: KeyedWaiters[str] = KeyedWaiters()
        self.listener = ChannelListener(client, self.keys.cancel_channel, self._add)

    async def start(self) -> None:
        await self.listener.start()

    async def close(self) -> None:
        await self.listener.close()

    def _add(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > self.remember:
            self._ids.popitem(last=False)
        self._waiters.wake(request_id)

    async def wait(self, request_id: str) -> None:
        """Return once a cancel of ``request_id`` is announced (at once if one was seen): what
        a worker races a long wait against, so a cancel does not leave it waiting out its
        timeout for work the cancel stopped (an embedding the encoder skipped)."""
        if request_id in self._ids:
            return
        futs = self._waiters.register([request_id])
        try:
            await futs[request_id]
        finally:
            self._waiters.forget(futs)

    def cancelled_now(self, request_id: str) -> bool:
        """True when a cancel of ``request_id`` has been seen (any thread may call this)."""
        return request_id in self._ids

    async def is_cancelled(self, request_id: str) -> bool:
        """True when ``request_id`` is cancelled; a Redis error counts as not cancelled (the
        status record already refuses any outcome after a cancel)."""
        if request_id in self._ids:
            return True
        try:
            found = bool(await self.client.exists(self.keys.cancel(request_id)))
        except RedisError:
            return False
        if found:
            self._add(request_id)
        return found
