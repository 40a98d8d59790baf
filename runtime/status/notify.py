"""Status-change notifications: a pub/sub listener that survives reconnects, and the waiters
that long-polls and event streams sleep on (woken by a message, never a polling loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

if TYPE_CHECKING:
    from runtime.status.store import StatusStore
    from schemas.status_record import StatusRecord

log = logging.getLogger(__name__)


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


def forget(waiters: dict[str, set[Any]], request_id: str, waiter: Any) -> None:
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
            store.client, store.keys.status_notify, self._wake, on_gap=self._wake_all
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
            forget(self._waiters, request_id, ev)

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
