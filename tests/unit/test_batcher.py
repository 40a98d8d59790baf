"""MicroBatcher: concurrent submits share compute calls, within the cost budget, in order."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest

from gpu_workers.batcher import MicroBatcher


async def test_concurrent_items_share_one_call() -> None:
    calls: list[list[int]] = []

    def compute(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        return [i * 10 for i in items]

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=100, linger_s=0.01)
    out = await asyncio.gather(*(b.submit(i, cost=10) for i in range(5)))
    await b.close()
    assert out == [0, 10, 20, 30, 40]
    assert calls == [[0, 1, 2, 3, 4]]
    assert b.batches == 1 and b.items == 5


async def test_budget_splits_batches_and_keeps_order() -> None:
    calls: list[list[int]] = []

    def compute(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        return list(items)

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=25, linger_s=0.01)
    out = await asyncio.gather(*(b.submit(i, cost=10) for i in range(5)))
    await b.close()
    assert out == list(range(5))
    assert [x for c in calls for x in c] == list(range(5))
    assert all(len(c) <= 2 for c in calls)


async def test_oversize_item_runs_alone() -> None:
    calls: list[list[int]] = []

    def compute(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        return list(items)

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=5, linger_s=0)
    assert await b.submit(1, cost=50) == 1
    await b.close()
    assert calls == [[1]]


async def test_compute_error_reaches_every_submitter_and_batcher_survives() -> None:
    fail = True

    def compute(items: Sequence[int]) -> list[int]:
        if fail:
            raise RuntimeError("boom")
        return list(items)

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=100, linger_s=0.01)
    results = await asyncio.gather(*(b.submit(i, 1) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)
    fail = False
    assert await b.submit(9, 1) == 9
    await b.close()


async def test_closed_batcher_refuses_work() -> None:
    def compute(items: Sequence[int]) -> list[int]:
        return list(items)

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=1, linger_s=0)
    await b.submit(1, 1)
    await b.close()
    with pytest.raises(RuntimeError):
        # the executor is shut down: a closed batcher refuses new work loudly
        await b.submit(2, 1)


async def test_one_bad_item_does_not_fail_its_batch_mates() -> None:
    calls: list[list[int]] = []

    def compute(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        if -1 in items:
            raise ValueError("bad item")
        return [i * 2 for i in items]

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=100, linger_s=0.01)
    results = await asyncio.gather(*(b.submit(i, 1) for i in (1, -1, 3)), return_exceptions=True)
    await b.close()
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], ValueError)
    assert calls[0] == [1, -1, 3]  # batched first, then each alone
    assert sorted(map(tuple, calls[1:])) == [(-1,), (1,), (3,)]


async def test_close_releases_every_submitter() -> None:
    release = threading.Event()

    def compute(items: Sequence[int]) -> list[int]:
        release.wait(5)  # the first batch is still running when close() comes
        return list(items)

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=1, linger_s=0)
    waiters = [asyncio.create_task(b.submit(i, 1)) for i in range(3)]
    await asyncio.sleep(0.1)  # item 0 is in the executor, 1 and 2 are queued
    await b.close()
    release.set()
    _, pending = await asyncio.wait(waiters, timeout=2)
    assert not pending, "a submitter was left waiting after close()"
    assert all(w.cancelled() for w in waiters)


async def test_a_lone_item_does_not_wait_for_the_linger() -> None:
    b: MicroBatcher[int, int] = MicroBatcher(lambda xs: list(xs), max_cost=100, linger_s=30.0)
    # nothing else announced: the 30 s linger is never waited for
    assert await asyncio.wait_for(b.submit(7, cost=1), 5.0) == 7
    await b.close()


async def test_announced_items_join_the_batch_being_formed() -> None:
    calls: list[list[int]] = []

    def compute(items: Sequence[int]) -> list[int]:
        calls.append(list(items))
        return list(items)

    b: MicroBatcher[int, int] = MicroBatcher(compute, max_cost=100, linger_s=30.0)

    async def handler(i: int, fetch_s: float) -> int:
        with b.on_the_way():
            await asyncio.sleep(fetch_s)  # fetching its inputs
            return await b.submit(i, cost=1)

    out = await asyncio.wait_for(
        asyncio.gather(handler(0, 0.0), handler(1, 0.05), handler(2, 0.1)), 10.0
    )
    await b.close()
    assert out == [0, 1, 2] and calls == [[0, 1, 2]]


async def test_a_withdrawn_announcement_ends_the_linger() -> None:
    b: MicroBatcher[int, int] = MicroBatcher(lambda xs: list(xs), max_cost=100, linger_s=30.0)

    async def failing() -> None:
        with b.on_the_way():
            await asyncio.sleep(0.05)
            raise ValueError("bad input")

    async def lone() -> int:
        await asyncio.sleep(0.01)
        return await b.submit(5, cost=1)

    results = await asyncio.wait_for(
        asyncio.gather(failing(), lone(), return_exceptions=True), 10.0
    )
    await b.close()
    assert isinstance(results[0], ValueError) and results[1] == 5
