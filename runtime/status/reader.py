"""What workers read of a request's status record before (re)doing its work."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from schemas.statuses import TERMINAL_STATUSES

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
        self._replicas_seen: set[str] = set()
        self._promoted_ms: dict[str, int] = {}

    async def __call__(self, request_id: str, since: bool = False) -> RequestState | None:
        """The request's state (with ``records_since_ms`` when ``since``: two more round
        trips), or None when Redis cannot be read (the caller cannot tell)."""
        if isinstance(self.status.client, RedisCluster):
            self._observe_roles(self.status.client, int(time.time() * 1000))
        try:
            rec = await self.status.get(request_id)
            started = await self._records_since(request_id) if since else None
        except (RedisError, OSError, KeyError, ValueError) as exc:
            log.warning("cannot read the state of %s: %r", request_id, exc)
            return None
        if rec is None:
            return RequestState(None, frozenset(), records_since_ms=started)
        return RequestState(
            rec.status, rec.encoded_items(), oldest_ms=rec.oldest_ms, records_since_ms=started
        )

    async def _records_since(self, request_id: str) -> int:
        """Since when the Redis holding the request's record has held what it holds: its start
        (uptime, on its own clock), or on a cluster, if later, when this process first saw the
        master of the record's slot promoted from a replica (a failover keeps the replicated
        records but may lose the last writes before it)."""
        client = self.status.client
        node = None
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(self.status.keys.status(request_id))
            info: Any = await client.info("server", target_nodes=node)
            now_s, now_us = await client.time(target_nodes=node)
        else:
            info = await client.info("server")
            now_s, now_us = await client.time()
        now = int(now_s) * 1000 + int(now_us) // 1000
        started = now - (int(info["uptime_in_seconds"]) + 1) * 1000
        if isinstance(client, RedisCluster) and node is not None:
            started = max(started, self._promotion_ms(client, node.name, now))
        return started

    def _observe_roles(self, client: RedisCluster, now: int) -> None:
        """Note the cluster's roles as the client's slot map has them (a local read, no round
        trip): a node seen a replica and now a master was promoted, at the latest ``now``.
        Every read notes them, so a worker that served requests before a failover knows the
        replicas as they were when the failover comes."""
        replicas = {n.name for n in client.get_replicas()}
        for primary in client.get_primaries():
            if primary.name in self._replicas_seen:
                self._promoted_ms.setdefault(primary.name, now)
        for name in replicas & set(self._promoted_ms):
            del self._promoted_ms[name]  # demoted again (its old master came back)
        self._replicas_seen.update(replicas)

    def _promotion_ms(self, client: RedisCluster, name: str, now: int) -> int:
        """When ``name`` was first seen a master after being seen a replica (0: never)."""
        self._observe_roles(client, now)
        return self._promoted_ms.get(name, 0)


RequestStateReader = Callable[..., Awaitable[RequestState | None]]
"""``(request_id, since=False)``: a :class:`RequestReader`, or a stand-in for one."""
