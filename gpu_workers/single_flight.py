"""Single-flight: at most one task does the work of a key at a time; the others wait for it.

The encode worker uses it so that two events of one image arriving together run the vision tower
once: the first owns the key's flight, the second waits and then finds the work done. An owner
that gives up (its request was cancelled) or is cancelled hands the work to a waiter; an owner
that fails passes its exception to its waiters (each retries its own event).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from types import TracebackType
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class SingleFlight(Generic[K]):
    """The flights in progress, one per key."""

    def __init__(self) -> None:
        self._flights: dict[K, asyncio.Future[None]] = {}

    def busy(self, key: K) -> bool:
        """Whether some task owns ``key``'s flight now."""
        return key in self._flights

    async def join(self, key: K) -> Flight[K] | None:
        """Wait while another task owns ``key``'s flight. None: an owner did the work (the
        caller has nothing left to do); a :class:`Flight`: the caller owns the key now (no one
        did, or the owner gave up) and must end it, as a ``with`` block around the work.

        The owner's failure is raised here too. Cancelling the caller cancels only its wait."""
        while (pending := self._flights.get(key)) is not None:
            try:
                await asyncio.shield(pending)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # this caller is being cancelled, not the owner
                continue  # the owner gave up or was cancelled: take the work over
            return None
        # No await between the look and the registration: no second owner can slip in.
        return Flight(self, key)


class Flight(Generic[K]):
    """One owner's claim on a key, released when its ``with`` block ends: waiters learn the
    work is done (a normal exit), failed (an exception: they get it too) or abandoned
    (:meth:`give_up`, or the owner cancelled: one of them takes over)."""

    def __init__(self, flights: SingleFlight[K], key: K) -> None:
        self._flights = flights
        self._key = key
        self._done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._given_up = False
        flights._flights[key] = self._done

    def give_up(self) -> None:
        """End this flight without the work done: a waiter takes it over instead of finding it
        done (e.g. the owner's request was cancelled, another waiter's was not)."""
        self._given_up = True

    def __enter__(self) -> Flight[K]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._flights._flights.get(self._key) is self._done:
            del self._flights._flights[self._key]
        done = self._done
        if done.done():
            return
        if exc is None and not self._given_up:
            done.set_result(None)
        elif exc is None or self._given_up or isinstance(exc, asyncio.CancelledError):
            done.cancel()  # waiters take over instead of failing
        else:
            done.set_exception(exc)
            done.exception()  # retrieved: each waiter re-raises its own copy
