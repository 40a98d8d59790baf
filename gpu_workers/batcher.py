"""Micro-batching of encoder work: concurrent requests share one vision-tower call.

Handlers ``submit`` one item and await its result. A single drain task takes whatever is
queued (up to a patch budget), runs the compute function once on its thread
(``runtime.thread_lane``), and resolves each item's future with its slice. Nothing here
knows about Kafka or models.

Lingering: a batch waits for more items only while a handler has said one is on its way
(:meth:`MicroBatcher.on_the_way`, e.g. while it fetches the item's inputs), and at most
``linger_s``. A lone request never pays a timer; a burst still shares one call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Generic, TypeVar

from runtime.thread_lane import ThreadLane

In = TypeVar("In")
Out = TypeVar("Out")

# Set inside ``on_the_way``: this task's next submit is the item announced there.
_announced: ContextVar[bool] = ContextVar("epd_batcher_announced", default=False)


@dataclass(slots=True)
class _Pending(Generic[In, Out]):
    item: In
    cost: int
    future: asyncio.Future[Out]


class MicroBatcher(Generic[In, Out]):
    """Collects submitted items into batches bounded by a cost budget."""

    def __init__(
        self,
        compute: Callable[[Sequence[In]], list[Out]],
        *,
        max_cost: int,
        linger_s: float = 0.002,
        lane: ThreadLane | None = None,
    ) -> None:
        self._compute = compute
        self._max_cost = max_cost
        self._linger_s = linger_s
        self._lane = lane or ThreadLane("epd-encode")
        self._queue: asyncio.Queue[_Pending[In, Out]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._coming = 0  # items announced by on_the_way and not submitted (or given up) yet
        self._arrival = asyncio.Event()
        self.batches = 0
        """Number of compute calls made so far."""
        self.items = 0

    @contextlib.contextmanager
    def on_the_way(self) -> Iterator[None]:
        """Announce that this task will ``submit`` an item soon (it is fetching its inputs):
        a batch being formed may wait for it, up to ``linger_s``. Leaving the block without
        submitting (a failure) withdraws the announcement."""
        self._coming += 1
        token = _announced.set(True)
        try:
            yield
        finally:
            if _announced.get():
                self._withdraw()
            _announced.reset(token)

    def _withdraw(self) -> None:
        _announced.set(False)
        self._coming -= 1
        self._arrival.set()

    async def submit(self, item: In, cost: int) -> Out:
        """Queue one item and wait for its result (exceptions of the batch propagate)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="epd-batcher")
        fut: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(item, cost, fut))
        if _announced.get():
            self._withdraw()  # the announced item is here
        return await fut

    async def _linger(self) -> None:
        """Wait (at most ``linger_s``) while announced items are still on their way."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._linger_s
        while self._coming > 0:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrival.clear()
            try:
                await asyncio.wait_for(self._arrival.wait(), remaining)
            except TimeoutError:
                return

    async def _next_batch(self, backlog: deque[_Pending[In, Out]]) -> list[_Pending[In, Out]]:
        if not backlog:
            backlog.append(await self._queue.get())
            if self._linger_s > 0:
                await self._linger()  # let announced submitters join this batch
        while not self._queue.empty():
            backlog.append(self._queue.get_nowait())
        # Always take the head (an item over budget runs alone); keep submission order.
        batch = [backlog.popleft()]
        cost = batch[0].cost
        while backlog and cost + backlog[0].cost <= self._max_cost:
            cost += backlog[0].cost
            batch.append(backlog.popleft())
        return batch

    async def _drain(self) -> None:
        backlog: deque[_Pending[In, Out]] = deque()
        live: list[_Pending[In, Out]] = []
        try:
            while True:
                batch = await self._next_batch(backlog)
                live = [p for p in batch if not p.future.cancelled()]
                if not live:
                    continue
                try:
                    results = await self._lane.run(self._compute, [p.item for p in live])
                except Exception as exc:
                    if len(live) == 1:
                        _fail(live[0], exc)
                    else:
                        # One bad item must not fail its batch mates: run each on its own.
                        for p in live:
                            await self._run_alone(p)
                    live = []
                    continue
                self.batches += 1
                self.items += len(live)
                for p, r in zip(live, results, strict=True):
                    if not p.future.done():
                        p.future.set_result(r)
                live = []
        finally:
            # Closing (or a bug) must not leave submitters waiting forever.
            for p in [*live, *backlog]:
                p.future.cancel()

    async def _run_alone(self, p: _Pending[In, Out]) -> None:
        try:
            (result,) = await self._lane.run(self._compute, [p.item])
        except Exception as exc:
            _fail(p, exc)
            return
        self.batches += 1
        self.items += 1
        if not p.future.done():
            p.future.set_result(result)

    async def close(self) -> None:
        """Stop the drain task; pending submitters get CancelledError."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        while not self._queue.empty():
            self._queue.get_nowait().future.cancel()
        self._lane.shutdown()


def _fail(p: _Pending[In, Out], exc: Exception) -> None:
    if not p.future.done():
        p.future.set_exception(exc)
