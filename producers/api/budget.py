"""A byte budget shared by the requests of one API process.

Bodies are held whole while they are parsed and rendered, so without a bound N concurrent
legal bodies cost N times the largest: memory grows with the load and the event loop and the
worker threads spend their time on bytes that will be refused anyway. The budget is taken
before the bytes are held (a declared ``Content-Length`` up front, an undeclared length as it
grows) and given back when the request is done with them; a take that does not fit is refused
at once (the caller answers 503 with ``Retry-After``), never queued, so a flood costs the
process no more than the budget and the other requests keep their latency.
"""

from __future__ import annotations

from dataclasses import dataclass


class ByteBudget:
    """``total`` bytes, taken and given back by the requests of one process (event loop only:
    no lock; takes and gives happen on the loop thread)."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError("a byte budget needs at least one byte")
        self.total = total
        self.used = 0

    @property
    def free(self) -> int:
        """Bytes not taken."""
        return self.total - self.used

    def take(self, n: int) -> bool:
        """Take ``n`` bytes when they fit (True), else take nothing (False)."""
        if n < 0:
            raise ValueError("cannot take a negative number of bytes")
        if n > self.free:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        """Give back ``n`` bytes taken earlier."""
        self.used = max(0, self.used - n)


@dataclass(slots=True)
class Reservation:
    """What one request holds of a :class:`ByteBudget`: it grows as the request needs more
    and goes back whole by :meth:`release` (idempotent)."""

    budget: ByteBudget
    held: int = 0

    def cover(self, n: int) -> bool:
        """Hold at least ``n`` bytes in all (take the difference); False when it does not fit
        (what was held stays held)."""
        more = n - self.held
        if more <= 0:
            return True
        if not self.budget.take(more):
            return False
        self.held = n
        return True

    def release(self) -> None:
        """Give everything held back."""
        self.budget.give(self.held)
        self.held = 0
