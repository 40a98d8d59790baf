"""Keyed waiters: futures that wait for keys, and the one "register, look, then wait" loop.

Every store's ``wait`` and the status notifications have the same shape: register a future per
key *first*, then look which keys are still missing, then sleep until one of their futures is
woken (a put, a notification, a file event), and look again or trust the wake. Registering
before looking is what makes it race-free: a put landing between the look and the sleep has
already woken a registered future. :class:`KeyedWaiters` holds the futures; :func:`wait_present`
is the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class KeyedWaiters(Generic[K]):
    """The futures waiting on each key. ``threadsafe``: for one shared by event loops in
    several threads (each future is then woken on its own loop)."""

    def __init__(self, *, threadsafe: bool = False) -> None:
        self._by_key: dict[K, set[asyncio.Future[None]]] = {}
        self._lock: contextlib.AbstractContextManager[object] = (
            threading.Lock() if threadsafe else contextlib.nullcontext()
        )

    def register(self, keys: Iterable[K]) -> dict[K, asyncio.Future[None]]:
        """A new future on the running loop for each of ``keys`` (registered at once)."""
        loop = asyncio.get_running_loop()
        futs = {k: loop.create_future() for k in keys}
        with self._lock:
            for k, fut in futs.items():
                self._by_key.setdefault(k, set()).add(fut)
        return futs

    def wake(self, key: K, error: BaseException | None = None) -> None:
        """Resolve the futures waiting on ``key`` (each on its own loop), or fail them with
        ``error``."""
        with self._lock:
            futs = list(self._by_key.get(key, ()))
        for fut in futs:
            _resolve(fut, error)

    def keys(self) -> list[K]:
        """The keys something waits on now."""
        with self._lock:
            return list(self._by_key)

    def wake_all(self, error: BaseException | None = None) -> None:
        """Resolve every future, or fail every one with ``error``."""
        with self._lock:
            futs = [f for group in self._by_key.values() for f in group]
        for fut in futs:
            _resolve(fut, error)

    def forget(self, futs: Mapping[K, asyncio.Future[None]]) -> None:
        """Unregister ``futs`` (cancelling those not done; a failure set on one is retrieved)."""
        with self._lock:
            for k, fut in futs.items():
                if not fut.done():
                    fut.cancel()
                elif not fut.cancelled():
                    fut.exception()
                group = self._by_key.get(k)
                if group is not None:
                    group.discard(fut)
                    if not group:
                        del self._by_key[k]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(g) for g in self._by_key.values())


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    def settle() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    loop = fut.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        settle()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(settle)


async def wait_present(
    waiters: KeyedWaiters[K],
    keys: Sequence[K],
    timeout_s: float,
    *,
    missing: Callable[[list[K]], Awaitable[list[K]]],
    timed_out: Callable[[list[K]], BaseException],
    recheck: bool = True,
    registered: Callable[[], None] | None = None,
) -> None:
    """Until none of ``keys`` is ``missing`` (deduplicated, order kept), or raise
    ``timed_out(still_missing)`` after ``timeout_s``.

    Each round registers a future per key, calls ``registered`` (a check that what will wake
    them is still live), asks ``missing``, and waits for a future of a missing key. With
    ``recheck`` a wake is a hint and the next round looks again; without it a wake means
    present (one look in all: the notification came from the write itself). A future failed
    by its waker raises that failure here.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pending = list(dict.fromkeys(keys))
    while pending:
        futs = waiters.register(pending)
        try:
            if registered is not None:
                registered()
            pending = await missing(pending)
            while pending:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise timed_out(pending)
                done, _ = await asyncio.wait(
                    [futs[k] for k in pending],
                    timeout=remaining,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for fut in done:
                    failure = fut.exception()
                    if failure is not None:
                        raise failure
                if recheck:
                    break  # look again, with fresh futures
                pending = [k for k in pending if not futs[k].done()]
        finally:
            waiters.forget(futs)
