"""What a consume loop costs while nothing happens: how often it wakes, and how its fetches wait.

An idle worker should cost (nearly) nothing: with no records, nothing in flight and nothing to
commit, a loop has no reason to wake but a record, a stop or a rebalance, and every wake-up of
a Python process is a fraction of a millisecond of CPU. Two parts keep it asleep:

* :class:`PollPace`: how long one poll (``getmany``) may wait. While handlers run or offsets
  wait to be committed, a round ends every ``poll_timeout_ms`` so the interval commit keeps its
  cadence; otherwise ``idle_poll_timeout_ms`` (a record ends the wait at once either way, and a
  stop or a freed slot ends it through the loop's other waits).
* :class:`IdleFetch`: how the broker holds a fetch. A loop idle for ``idle_after_s`` switches its
  consumer to the idle fetch: wait up to ``EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS`` for the first
  record (min bytes 1). Apache Kafka answers a waiting fetch as soon as a record lands, so the
  longer wait costs no latency and saves the polls; Tansu answers only when the wait ends, so
  there it is the latency of each hop's first record after a quiet spell. The first record (or
  any work) switches back to the stage's own fetch, so traffic never runs on the idle one: a
  seek back (a give-back, an aborted transaction, a lost log) waits at most the active wait for
  the fetch already on its way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["FetchParams", "IdleFetch", "PollPace"]


@dataclass(frozen=True, slots=True)
class FetchParams:
    """How long the broker may hold a fetch, and how many bytes it gathers first."""

    wait_ms: int
    min_bytes: int = 1


@dataclass(frozen=True, slots=True)
class PollPace:
    """How long one poll waits: short while anything is owed, long when there is nothing."""

    busy_ms: int
    idle_ms: int

    def timeout_ms(self, busy: bool) -> int:
        return self.busy_ms if busy else max(self.busy_ms, self.idle_ms)


class IdleFetch:
    """Which fetch a consumer should use: ``active`` while records or work came within
    ``idle_after_s``, else the idle one (``idle_wait_ms``, first record). No idle fetch when
    ``idle_wait_ms`` is not longer than the active wait (nothing to save)."""

    def __init__(
        self,
        active: FetchParams,
        idle_wait_ms: int,
        idle_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.active = active
        self.idle = FetchParams(idle_wait_ms) if idle_wait_ms > active.wait_ms else None
        self.idle_after_s = idle_after_s
        self._clock = clock
        self._last_busy = clock()
        self.current = active
        self.switches = 0
        """Times the fetch changed (either way): for tests and status pages."""

    def observe(self, busy: bool) -> FetchParams | None:
        """After a poll round (``busy``: it returned records, or handlers run): the fetch to
        switch the consumer to, or None when it stays as it is."""
        now = self._clock()
        if busy:
            self._last_busy = now
            wanted = self.active
        elif self.idle is not None and now - self._last_busy >= self.idle_after_s:
            wanted = self.idle
        else:
            wanted = self.current
        if wanted == self.current:
            return None
        self.current = wanted
        self.switches += 1
        return wanted
