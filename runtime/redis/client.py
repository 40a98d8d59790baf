"""The one place redis-py clients for ``EPD_REDIS_URL`` are made (status records, DLQ ledger).

A ``redis+cluster://`` URL gives a Redis Cluster client (:mod:`runtime.redis.cluster`), with
the same bound: at most ``redis_max_connections`` commands in flight per process, each waiting
for a free one beyond that.

redis-py's default pool raises ``MaxConnectionsError: Too many connections`` as soon as more
commands are in flight than it has connections; a burst of submits (each status update WATCHes
its record on a connection of its own) then fails requests that only had to wait. A
``BlockingConnectionPool`` queues them instead: a command waits up to
``redis_pool_timeout_s`` for a connection, and the process never holds more than
``redis_max_connections``.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from runtime.redis.cluster import RedisClient, cluster_client, is_cluster_url
from runtime.settings import Settings

HEALTH_CHECK_S = 5.0


def redis_client(settings: Settings, url: str | None = None, **options: object) -> RedisClient:
    """A client on ``url`` (default ``settings.redis_url``) over a bounded, waiting pool.

    ``options`` go to the connections (e.g. ``socket_timeout``). Close it with
    ``await client.aclose()``; that also closes the pool it owns.
    """
    # A connection idle this long is PINGed (and remade) before use: after a Redis restart the
    # pool's old connections are dead, and a WATCH on one is not retried by redis-py.
    options.setdefault("health_check_interval", HEALTH_CHECK_S)
    # Set here, not left to redis-py's default (5 s since redis-py 8): a freeze or failover
    # of a few seconds is waited out, as the pool waits for a connection.
    options.setdefault("socket_timeout", settings.redis_socket_timeout_s)
    target = url or settings.redis_url
    if is_cluster_url(target):
        return cluster_client(target, max_connections=settings.redis_max_connections, **options)
    pool = aioredis.BlockingConnectionPool.from_url(
        target,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_timeout_s,
        **options,
    )
    return aioredis.Redis.from_pool(pool)  # the client owns the pool: aclose() closes both
