"""A thread lane: one dedicated thread that runs the calls an event loop hands it, in order.

A worker's compute (a decode step, an encode batch) must leave the event loop free, so each one
hops to a thread and back. ``loop.run_in_executor`` on a one-thread pool makes that hop heavy:
a ``concurrent.futures.Future`` with its lock and condition, the pool's semaphore and lock, and
an asyncio future chained to it by callbacks. A lane hands the call over with one queue put and
hands the result back with one ``call_soon_threadsafe``: about 27 µs of CPU per round trip on
the 2-core bench host against 70 µs through the pool. A decode worker hops once per step of
its batch, so the difference is paid per token.

Semantics are the pool's: calls run one at a time in submission order; a call whose caller was
cancelled before it started is skipped; :meth:`ThreadLane.shutdown` refuses new calls, cancels
the ones not started, and lets a running one finish.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Call = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class ThreadLane:
    """One thread, started on the first call, that runs the calls given to :meth:`run`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        return self._closed

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the lane's thread, once the calls before it have run."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"thread lane {self.name}: cannot run a call after shutdown")
            if self._thread is None:
                # A daemon, as the interpreter must not wait on a lane nobody shut down; the
                # thread sits in the queue's get (no Python state touched) when it exits.
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._calls.put((loop, fut, fn, args))
        return await fut

    def shutdown(self) -> None:
        """Refuse new calls; the ones not started are cancelled, a running one finishes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._thread is not None:
                self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            self._run_one(*call)
            del call  # hold nothing of the last call while idle

    def _run_one(
        self,
        loop: asyncio.AbstractEventLoop,
        fut: asyncio.Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        if self._closed or fut.cancelled():  # the caller gave up, or the lane is closing
            _hand_back(loop, fut.cancel)
            return
        try:
            result = fn(*args)
        except BaseException as exc:  # the caller's to handle, as with a pool
            _hand_back(loop, _settle, fut, None, exc)
        else:
            _hand_back(loop, _settle, fut, result, None)


def _hand_back(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody is left to tell
        pass


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():  # cancelled while it ran
        return
    if exc is None:
        fut.set_result(result)
    elif isinstance(exc, StopIteration):  # an asyncio future refuses it, as a coroutine would
        fut.set_exception(RuntimeError(f"call raised StopIteration: {exc!r}"))
    else:
        fut.set_exception(exc)
