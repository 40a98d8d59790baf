"""What workers read of a request's status record before (re)doing its work."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from schemas.types import TERMINAL_STATUSES

if TYPE_CHECKING:
    from runtime.status.store import StatusStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestState:
    """What a worker reads of a request's status record before (re)doing its work."""

    status: str | None
    """The record's status; None when there is no record (never made, expired, or wiped)."""
    encoded: frozenset[str]
    """Items (their :func:`~schemas.status_record.short_hash`) the encode stage stored or
    found cached, per the record."""
    oldest_ms: int | None = None
    """The earliest stage update the record holds (epoch ms); None without a record."""
    records_since_ms: int | None = None
    """Only when asked for: a time (epoch ms, Redis clock) before which the Redis holding the
    records had not started. Errs early, by up to two seconds (the server reports its uptime
    in whole seconds of a clock it caches)."""

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def wiped(self) -> bool:
        """The record holds nothing from before Redis last started (a restart may have lost
        it). Known only when ``records_since_ms`` was asked for."""
        since = self.records_since_ms
        return since is not None and (self.oldest_ms is None or self.oldest_ms >= since)


class RequestReader:
    """Reads :class:`RequestState` for workers (prefill: replay skip, lost-embedding check)."""

    def __init__(self, status: StatusStore) -> None:
        self.status = status

    async def __call__(self, request_id: str, since: bool = False) -> RequestState | None:
        """The request's state (with ``records_since_ms`` when ``since``: two more round
        trips), or None when Redis cannot be read (the caller cannot tell)."""
        try:
            rec = await self.status.get(request_id)
            started: int | None = None
            if since:
                info: Any = await self.status.client.info("server")
                now_s, now_us = await self.status.client.time()
                now = int(now_s) * 1000 + int(now_us) // 1000
                started = now - (int(info["uptime_in_seconds"]) + 1) * 1000
        except (RedisError, OSError, KeyError, ValueError) as exc:
            log.warning("cannot read the state of %s: %r", request_id, exc)
            return None
        if rec is None:
            return RequestState(None, frozenset(), records_since_ms=started)
        return RequestState(
            rec.status, rec.encoded_items(), oldest_ms=rec.oldest_ms, records_since_ms=started
        )


RequestStateReader = Callable[..., Awaitable[RequestState | None]]
"""``(request_id, since=False)``: a :class:`RequestReader`, or a stand-in for one."""
