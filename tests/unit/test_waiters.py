"""The keyed-waiters primitive every store wait is built on (runtime.redis.waiters), pure logic."""

from __future__ import annotations

import asyncio

import pytest

from runtime.redis.waiters import KeyedWaiters, wait_present


class Missing(Exception):
    pass


def present_after(store: set[str], looks: list[list[str]]):  # type: ignore[no-untyped-def]
    async def missing(keys: list[str]) -> list[str]:
        looks.append(list(keys))
        return [k for k in keys if k not in store]

    return missing


async def test_a_put_between_the_look_and_the_sleep_is_not_missed() -> None:
    """Registered before the look: a wake that lands right after the look still counts."""
    waiters: KeyedWaiters[str] = KeyedWaiters()
    store: set[str] = set()
    looks: list[list[str]] = []

    async def missing(keys: list[str]) -> list[str]:
        looks.append(list(keys))
        out = [k for k in keys if k not in store]
        store.add("a")  # the put lands now, after this look
        waiters.wake("a")
        return out

    await wait_present(waiters, ["a"], 1.0, missing=missing, timed_out=Missing)
    assert looks[0] == ["a"]  # one look said missing; the wake it raced with ended the wait
    assert len(waiters) == 0  # nothing left registered


async def test_trusting_a_wake_looks_once_and_rechecking_looks_again() -> None:
    for recheck, want_looks in ((False, 1), (True, 2)):
        waiters: KeyedWaiters[str] = KeyedWaiters()
        store: set[str] = set()
        looks: list[list[str]] = []

        async def put_later(store: set[str], waiters: KeyedWaiters[str]) -> None:
            await asyncio.sleep(0.01)
            store.add("k")
            waiters.wake("k")

        task = asyncio.create_task(put_later(store, waiters))
        await wait_present(
            waiters,
            ["k", "k"],
            1.0,
            missing=present_after(store, looks),
            timed_out=lambda left: Missing(left),
            recheck=recheck,
        )
        await task
        assert len(looks) == want_looks, (recheck, looks)
        assert looks[0] == ["k"]  # duplicates dropped


async def test_a_waker_failure_and_a_timeout_reach_the_waiter() -> None:
    waiters: KeyedWaiters[str] = KeyedWaiters()
    looks: list[list[str]] = []

    async def fail_soon() -> None:
        await asyncio.sleep(0.01)
        waiters.wake_all(RuntimeError("channel lost"))

    task = asyncio.create_task(fail_soon())
    with pytest.raises(RuntimeError, match="channel lost"):
        await wait_present(
            waiters, ["x"], 1.0, missing=present_after(set(), looks), timed_out=Missing
        )
    await task
    with pytest.raises(Missing) as exc:
        await wait_present(
            waiters, ["y", "z"], 0.02, missing=present_after({"z"}, looks), timed_out=Missing
        )
    assert exc.value.args == (["y"],)
    assert len(waiters) == 0
