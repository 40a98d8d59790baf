"""The single-flight primitive the encode worker dedupes concurrent encodes of one item with."""

from __future__ import annotations

import asyncio

import pytest

from gpu_workers.single_flight import SingleFlight


async def test_a_waiter_finds_the_owners_work_done() -> None:
    flights: SingleFlight[str] = SingleFlight()
    owner = await flights.join("k")
    assert owner is not None and flights.busy("k")
    waiter = asyncio.create_task(flights.join("k"))
    await asyncio.sleep(0)
    assert not waiter.done()  # waits while the owner works
    with owner:
        pass
    assert await waiter is None and not flights.busy("k")
    again = await flights.join("k")  # a later caller owns a fresh flight
    assert again is not None
    with again:
        pass


@pytest.mark.parametrize("how", ["give_up", "cancelled"])
async def test_an_owner_that_gives_up_hands_the_work_to_one_waiter(how: str) -> None:
    flights: SingleFlight[str] = SingleFlight()
    started = asyncio.Event()
    release = asyncio.Event()

    async def own() -> None:
        flight = await flights.join("k")
        assert flight is not None
        with flight:
            started.set()
            await release.wait()
            flight.give_up()

    owner = asyncio.create_task(own())
    await started.wait()
    waiters = [asyncio.create_task(flights.join("k")) for _ in range(2)]
    await asyncio.sleep(0)
    if how == "give_up":
        release.set()
        await owner
    else:
        owner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await owner
    first = await waiters[0]
    assert first is not None  # took the work over
    await asyncio.sleep(0)
    assert not waiters[1].done()  # and the other now waits for it
    with first:
        pass
    assert await waiters[1] is None


async def test_an_owners_failure_reaches_its_waiters() -> None:
    flights: SingleFlight[str] = SingleFlight()
    owner = await flights.join("k")
    assert owner is not None
    waiter = asyncio.create_task(flights.join("k"))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="tower"), owner:
        raise RuntimeError("vision tower failed")
    with pytest.raises(RuntimeError, match="tower"):
        await waiter
    assert not flights.busy("k")


async def test_cancelling_a_waiter_leaves_the_owner_alone() -> None:
    flights: SingleFlight[str] = SingleFlight()
    owner = await flights.join("k")
    assert owner is not None
    waiter = asyncio.create_task(flights.join("k"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert flights.busy("k")
    with owner:
        pass
    assert not flights.busy("k")
