"""The in-flight set: requests without an outcome yet, shared by every API replica and worker.

A sorted set (``RedisKeys.inflight``; member: request id, score: admission or first-record time,
ms). The API's admission adds to it under a bound; a record's first write adds its request (so a
record a router or a submitter made is counted too) and its outcome removes it; the results
collector's sweep reads it to find every request that could still hang.

On one Redis the record's compare-and-set script updates the set in the same step. On a Redis
Cluster the set is one key in a slot of its own, so it cannot share a script with a request's
record (which sits in the request's slot): :class:`~runtime.status.store.StatusStore` adds a
request *before* the write that makes its record (so no unfinished record is ever missing from
it: the sweep would never see that one) and removes it *after* the write of its outcome. A
process that dies between the two leaves a finished request in the set: admission counts it a
while longer, and the next sweep, finding its record finished, removes it (:meth:`unfinished`).
One key, not one per shard, because admission's bound is one atomic check-and-add across every
replica; its traffic is two small writes per request, far below what one shard serves.
"""

from __future__ import annotations

from typing import Any

from runtime.redis.cluster import RedisClient, read_many
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

    def __init__(self, client: RedisClient, keys: RedisKeys, *, ttl_s: int) -> None:
        self.client = client
        self.keys = keys
        self.ttl_s = ttl_s
        self._admit = client.register_script(_ADMIT)  # EVALSHA: the body is not sent each time

    async def admit(self, request_id: str, limit: int) -> bool:
        """Count ``request_id`` as in flight unless ``limit`` requests already are (atomic,
        shared by every API replica). Entries older than the record TTL are dropped, so a
        request whose outcome never arrives cannot hold a slot forever."""
        now = now_ms()
        ok = await self._admit(
            keys=[self.keys.inflight],
            args=[now - self.ttl_s * 1000, limit, now, request_id, self.ttl_s],
        )
        return bool(ok)

    async def release(self, request_id: str) -> None:
        """Give back an in-flight slot (a request that was not enqueued after all)."""
        await self.client.zrem(self.keys.inflight, request_id)

    async def add(self, request_id: str) -> None:
        """Count ``request_id`` in flight, unbounded (a record being made; admission already
        counted the API's requests, whose entries keep their admission time)."""
        await self.client.zadd(self.keys.inflight, {request_id: now_ms()}, nx=True)
        await self.client.expire(self.keys.inflight, self.ttl_s)

    async def count(self) -> int:
        """Admitted requests without an outcome yet."""
        return int(await self.client.zcard(self.keys.inflight))

    async def ids(self, limit: int) -> list[str]:
        """Up to ``limit`` unfinished request ids, the oldest first."""
        return [_name(i) for i in await self.client.zrange(self.keys.inflight, 0, limit - 1)]

    async def records(self, limit: int) -> list[StatusRecord]:
        """The status records of up to ``limit`` requests of the set (those that have one)."""
        names = await self.ids(limit)
        raws = await read_many(self.client, [self.keys.status(n) for n in names])
        return [StatusRecord.from_json(raw) for raw in raws if raw]

    async def unfinished(
        self, limit: int, *, orphaned_before_ms: int | None = None
    ) -> list[StatusRecord]:
        """:meth:`records` without the finished ones, whose entries are removed: what a process
        that died between a request's outcome and its removal left behind (cluster only).
        ``orphaned_before_ms``: the entries counted before then whose record is gone are
        removed too (its TTL, an eviction, an operator took it; no update makes it again, so
        no outcome would ever release the slot). A younger entry may be a record still being
        made (on a cluster the entry comes first), so it stays."""
        entries: Any = await self.client.zrange(self.keys.inflight, 0, limit - 1, withscores=True)
        names = [_name(n) for n, _ in entries]
        scores = [float(score) for _, score in entries]
        raws = await read_many(self.client, [self.keys.status(n) for n in names])
        recs = [StatusRecord.from_json(raw) for raw in raws if raw]
        cut = orphaned_before_ms
        gone = [
            name
            for name, score, raw in zip(names, scores, raws, strict=True)
            if not raw and cut is not None and score < cut
        ]
        finished = [r.request_id for r in recs if r.terminal]
        if finished or gone:
            await self.client.zrem(self.keys.inflight, *finished, *gone)
        return [r for r in recs if not r.terminal]

    async def by_status(self, limit: int = 10000) -> dict[str, int]:
        """Unfinished requests counted by status (one read of at most ``limit`` records)."""
        counts: dict[str, int] = {}
        for rec in await self.records(limit):
            if not rec.terminal:
                counts[rec.status] = counts.get(rec.status, 0) + 1
        return counts
