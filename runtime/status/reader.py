"""What workers read of a request's status record before (re)doing its work."""

from __future__ import annotations

import functools
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
        self._primary_since: dict[str, int] = {}

    async def __call__(self, request_id: str, since: bool = False) -> RequestState | None:
        """The request's state (with ``records_since_ms`` when ``since``: two more round
        trips), or None when Redis cannot be read (the caller cannot tell)."""
        if (cluster := self._cluster) is not None:
            self._observe_roles(cluster, int(time.time() * 1000))
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

    @functools.cached_property
    def _cluster(self) -> RedisCluster | None:
        """The status client when it is a cluster's. Judged once: an ``isinstance`` against
        redis-py's cluster class goes through typing's protocol check (its command mixins are
        Protocols), too slow for every read."""
        client = self.status.client
        return client if isinstance(client, RedisCluster) else None

    async def _records_since(self, request_id: str) -> int:
        """Since when the Redis holding the request's record has held what it holds: its start
        (uptime, on its own clock), or on a cluster, if later, when this process first saw the
        master of the record's slot a master, where that node took over from another (a
        failover keeps the replicated records but may lose the last writes before it)."""
        client = self.status.client
        node = None
        if isinstance(client, RedisCluster):
            node = client.get_node_from_key(self.status.keys.status(request_id))
            info: Any = await client.info("server", "replication", target_nodes=node)
            now_s, now_us = await client.time(target_nodes=node)
        else:
            info = await client.info("server")
            now_s, now_us = await client.time()
        now = int(now_s) * 1000 + int(now_us) // 1000
        started = now - (int(info["uptime_in_seconds"]) + 1) * 1000
        if isinstance(client, RedisCluster) and node is not None:
            promoted = self._promotion_ms(client, node.name, now, took_over=_took_over(info))
            started = max(started, promoted)
        return started

    def _observe_roles(self, client: RedisCluster, now: int) -> None:
        """Note the cluster's roles as the client's slot map has them (a local read, no round
        trip): when each master was first seen one, and which nodes were seen replicas. Every
        read notes them, so the first judgement after a failover knows the new master is new."""
        replicas = {n.name for n in client.get_replicas()}
        for primary in client.get_primaries():
            self._primary_since.setdefault(primary.name, now)
        for name in replicas:
            self._primary_since.pop(name, None)  # a replica (again): a later mastership is new
        self._replicas_seen.update(replicas)

    def _promotion_ms(
        self, client: RedisCluster, name: str, now: int, *, took_over: bool = False
    ) -> int:
        """When master ``name`` took over from another, at the latest (0: it did not). Two
        signals: the node says so (``took_over``: its INFO names a previous replication id),
        or this process saw it a replica before. Redis 7 leaves a replica that has not
        synced yet out of the slot map, so the first signal is the one a fresh cluster gives;
        the promotion is then dated when this process first saw the node a master (``now``
        if it never had), early enough for every record that a failover may have lost."""
        self._observe_roles(client, now)
        if not (took_over or name in self._replicas_seen):
            return 0
        return self._primary_since.get(name, now if took_over else 0)


def _took_over(info: dict[str, Any]) -> bool:
    """Whether a master's ``INFO replication`` says it took over from another master since it
    started: a replica promoted keeps its old master's replication id as ``master_replid2``
    (all zeros on a node that was always a master)."""
    replid2 = str(info.get("master_replid2") or "")
    return info.get("role") == "master" and replid2.strip("0") != ""


RequestStateReader = Callable[..., Awaitable[RequestState | None]]
"""``(request_id, since=False)``: a :class:`RequestReader`, or a stand-in for one."""
