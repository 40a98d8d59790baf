"""The in-flight set: requests without an outcome yet, shared by every API replica and worker.

A sorted set (``RedisKeys.inflight``; member: request id, score: admission or first-record time,
ms). The API's admission adds to it under a bound; a record's first write adds its request (so a
record a router or a submitter made is counted too) and its outcome removes it; the results
collector's sweep reads it to find every request that could still hang.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from schemas.keys import RedisKeys
from schemas.status_record import StatusRecord
from schemas.types import now_ms

# KEYS: the set. ARGV: drop entries scored at or below this (ms), the bound, now (ms), the id,
# the set's TTL (s). Returns 1 when admitted.
_ADMIT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _name(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


class InFlight:
    """Admission against, and reads of, the in-flight set."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys, *, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s

    async def admit(self, request_id: str, limit: int) -> bool:
        """Count ``request_id`` as in flight unless ``limit`` requests already are (atomic,
        shared by every API replica). Entries older than the record TTL are dropped, so a
        request whose outcome never arrives cannot hold a slot forever."""
        now = now_ms()
        ok = await self.client.eval(
            _ADMIT,
            1,
            self.keys.inflight,
            now - self.ttl_s * 1000,
            limit,
            now,
            request_id,
            self.ttl_s,
        )
        return bool(ok)

    async def release(self, request_id: str) -> None:
        """Give back an in-flight slot (a request that was not enqueued after all)."""
        await self.client.zrem(self.keys.inflight, request_id)

    async def count(self) -> int:
        """Admitted requests without an outcome yet."""
        return int(await self.client.zcard(self.keys.inflight))

    async def ids(self, limit: int) -> list[str]:
        """Up to ``limit`` unfinished request ids, the oldest first."""
        return [_name(i) for i in await self.client.zrange(self.keys.inflight, 0, limit - 1)]

    async def records(self, limit: int) -> list[StatusRecord]:
        """The status records of up to ``limit`` unfinished requests (those that have one)."""
        names = await self.ids(limit)
        if not names:
            return []
        raws = await self.client.mget([self.keys.status(n) for n in names])
        return [StatusRecord.from_json(raw) for raw in raws if raw]

    async def by_status(self, limit: int = 10000) -> dict[str, int]:
        """Unfinished requests counted by status (one read of at most ``limit`` records)."""
        counts: dict[str, int] = {}
        for rec in await self.records(limit):
            counts[rec.status] = counts.get(rec.status, 0) + 1
        return counts
