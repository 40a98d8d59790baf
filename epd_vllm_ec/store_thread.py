"""One embedding store, driven from synchronous code through a private event-loop thread.

vLLM calls a connector from synchronous code (the scheduler's step, the model runner's
forward), while our stores are asyncio clients whose connections belong to the loop that opened
them. So the connector owns one loop on one daemon thread for its whole life: the store is
opened on it, every call is submitted to it and waited for with a bound, and vLLM's own thread
(or any loop it runs) is never borrowed. A fresh ``asyncio.run`` per call would reconnect every
time and leave the store's pub/sub listener and pooled connections bound to dead loops.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from runtime.stores import open_store
from runtime.stores.base import EmbeddingStore
from runtime.stores.errors import StoreTimeout

T = TypeVar("T")


class StoreThread:
    """A store opened on a private loop thread; :meth:`call` runs one operation on it."""

    def __init__(self, url: str, *, name: str = "epd-ec-store") -> None:
        """Start the thread and open ``url`` on it (no connection is made until first use)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self.store: EmbeddingStore = self._submit(self._open(url)).result()
        except BaseException:
            self._stop(5.0)
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @staticmethod
    async def _open(url: str) -> EmbeddingStore:
        return open_store(url)

    def _submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        async def run() -> T:
            return await coro

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    @property
    def url(self) -> str:
        """The store's URL (what entries name: ``EmbeddingStore.url``)."""
        return self.store.url

    def call(self, op: Callable[[EmbeddingStore], Awaitable[T]], timeout_s: float) -> T:
        """``await op(store)`` on the store's loop; waits at most ``timeout_s`` (then the
        operation is cancelled and :class:`StoreTimeout` raised). Store errors propagate."""
        if self._closed:
            raise RuntimeError("the connector's store thread is closed")
        future = self._submit(op(self.store))
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StoreTimeout([f"<store operation on {self.url}>"], timeout_s) from None

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the store and stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(self.store.close()).result(timeout_s)
        finally:
            self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._loop.close()
