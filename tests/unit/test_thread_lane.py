"""``runtime.thread_lane.ThreadLane``: one thread, calls in order, the pool's semantics."""

from __future__ import annotations

import asyncio
import threading

import pytest

from runtime.thread_lane import ThreadLane


async def test_calls_run_in_order_on_one_thread_off_the_loop() -> None:
    lane = ThreadLane("t-order")
    ran: list[tuple[int, str]] = []

    def work(i: int) -> int:
        ran.append((i, threading.current_thread().name))
        return i * 10

    try:
        got = await asyncio.gather(*(lane.run(work, i) for i in range(20)))
    finally:
        lane.shutdown()
    assert got == [i * 10 for i in range(20)]
    assert [i for i, _ in ran] == list(range(20))
    assert {name for _, name in ran} == {"t-order"}
    assert threading.current_thread().name != "t-order"


async def test_a_calls_exception_reaches_its_caller_and_the_lane_goes_on() -> None:
    lane = ThreadLane("t-raise")

    def bad() -> None:
        raise ValueError("bad step")

    def stop() -> None:
        raise StopIteration  # an asyncio future refuses this one as is

    try:
        with pytest.raises(ValueError, match="bad step"):
            await lane.run(bad)
        with pytest.raises(RuntimeError, match="StopIteration"):
            await lane.run(stop)
        assert await lane.run(lambda: "still here") == "still here"
    finally:
        lane.shutdown()


async def test_a_call_whose_caller_gave_up_before_it_started_does_not_run() -> None:
    lane = ThreadLane("t-cancel")
    gate = threading.Event()
    ran: list[str] = []

    def first() -> str:
        gate.wait(10)
        ran.append("first")
        return "first"

    try:
        running = asyncio.create_task(lane.run(first))
        queued = asyncio.create_task(lane.run(ran.append, "queued"))
        await asyncio.sleep(0.05)
        queued.cancel()
        gate.set()
        assert await running == "first"
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert await lane.run(lambda: "after") == "after"  # the skipped call came before this
    finally:
        lane.shutdown()
    assert ran == ["first"]


async def test_shutdown_refuses_new_calls_cancels_queued_ones_lets_the_running_one_end() -> None:
    lane = ThreadLane("t-shutdown")
    gate = threading.Event()
    ran: list[str] = []

    def running() -> str:
        gate.wait(10)
        ran.append("running")
        return "done"

    first = asyncio.create_task(lane.run(running))
    queued = asyncio.create_task(lane.run(ran.append, "queued"))
    await asyncio.sleep(0.05)
    lane.shutdown()
    lane.shutdown()  # twice is fine
    gate.set()
    assert await asyncio.wait_for(first, 10) == "done"
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(queued, 10)
    with pytest.raises(RuntimeError, match="after shutdown"):
        await lane.run(ran.append, "late")
    assert ran == ["running"] and lane.closed


async def test_a_lane_serves_callers_on_two_event_loops() -> None:
    """Each call is handed back to the loop that made it (a lane may outlive a test's loop)."""
    lane = ThreadLane("t-loops")
    here = await lane.run(lambda: threading.current_thread().name)

    def other_loop() -> str:
        return asyncio.run(lane.run(lambda: threading.current_thread().name))

    there = await asyncio.to_thread(other_loop)
    lane.shutdown()
    assert here == there == "t-loops"
