"""Redis Cluster: the ``redis+cluster://`` URL, the client, and the slot arithmetic we rely on.

``redis+cluster://[user:password@]host:port[,host:port...][/][?options]`` names a cluster by its
seed nodes; any reachable seed is enough to learn the rest (redis-py's asyncio ``RedisCluster``
keeps the slot map and follows ``MOVED``/``ASK`` itself). :attr:`ClusterURL.name` is the cluster's
normalised name (seeds lower-cased, deduplicated and sorted, default port filled in, credentials
left out, only the options that change what a key means kept): what an embedding entry signs as
its store, so every process configured with the same seeds, in any order, agrees on it.

Reads go to masters only: a replica may still lack the value a reader was just woken for.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from binascii import crc_hqx
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

from runtime.stores.url_options import SECONDS, url_seconds

SCHEME = "redis+cluster"
DEFAULT_PORT = 6379
IDENTITY_OPTIONS = ("key_prefix",)
"""Options that change what a key names (kept in :attr:`ClusterURL.name`); the rest (timeouts,
pool sizes, channel names) are how one process talks to the cluster."""


RedisClient = aioredis.Redis | RedisCluster
"""A client of one Redis or of a Redis Cluster (what :func:`runtime.redis.client.redis_client`
returns for ``EPD_REDIS_URL``)."""


def is_cluster_url(url: str) -> bool:
    """Whether ``url`` names a Redis Cluster (``redis+cluster://``)."""
    return url.split("://", 1)[0].lower() == SCHEME


def _seed(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = text.strip(), str(DEFAULT_PORT)
    host = host.strip("[]").lower()
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text.strip()!r} in {url!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class ClusterURL:
    """A parsed ``redis+cluster://`` URL."""

    seeds: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    options: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, url: str) -> ClusterURL:
        """Parse ``url``; ValueError naming what is wrong (scheme, a seed, a path)."""
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() != SCHEME:
            raise ValueError(f"not a {SCHEME}:// URL: {url!r}")
        netloc, _, query = rest.partition("?")
        netloc, _, path = netloc.partition("/")
        if path.strip("/") not in ("", "0"):
            raise ValueError(f"a Redis Cluster has only database 0, not /{path} ({url!r})")
        auth, at, hosts = netloc.rpartition("@")
        username = password = None
        if at:
            user, colon, secret = auth.partition(":")
            username = unquote(user) or None
            password = unquote(secret) if colon else None
        seeds = [_seed(part, url) for part in hosts.split(",") if part.strip()]
        if not seeds:
            raise ValueError(f"{url!r} names no seed node (redis+cluster://HOST:PORT[,HOST:PORT])")
        return cls(tuple(sorted(set(seeds))), username, password, tuple(sorted(parse_qsl(query))))

    def option(self, name: str, default: str | None = None) -> str | None:
        return dict(self.options).get(name, default)

    @property
    def name(self) -> str:
        """The normalised name of the cluster (see the module docstring)."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.seeds)
        kept = [(k, v) for k, v in self.options if k in IDENTITY_OPTIONS]
        return f"{SCHEME}://{hosts}" + (f"?{urlencode(kept, safe=':')}" if kept else "")


class BoundedRedisCluster(RedisCluster):
    """A ``RedisCluster`` whose commands wait for one of ``max_commands`` slots.

    redis-py's cluster nodes raise ``MaxConnectionsError`` as soon as more commands are in
    flight to a node than it has connections (there is no blocking pool for the cluster), so a
    burst would fail requests that only had to wait. Bounding the process's commands in flight
    to each node's connection count keeps every node within its pool.

    The client's first command runs alone: with redis-py 8.1, commands started together on a
    client that has not yet learnt the cluster can fail while it does (``AttributeError`` on a
    connection still being made); the ones after it are free to run at once."""

    def __init__(self, *args: Any, max_commands: int, **kwargs: Any) -> None:
        kwargs["max_connections"] = max_commands
        super().__init__(*args, **kwargs)
        self._command_slots = asyncio.Semaphore(max_commands)
        self._first = asyncio.Lock()
        self._learnt = False

    async def initialize(self, *args: Any, **kwargs: Any) -> BoundedRedisCluster:
        """As redis-py's, except that no reachable seed is a ``ConnectionError`` (what a
        single Redis that does not answer raises), not a bare ``RedisClusterException``."""
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            if type(exc) is RedisClusterException:  # "Redis Cluster cannot be connected"
                raise RedisConnectionError(str(exc)) from exc
            raise
        return self

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if not self._learnt:
            async with self._first:
                if not self._learnt:
                    async with self._command_slots:
                        result = await super().execute_command(*args, **kwargs)
                    self._learnt = True
                    return result
        async with self._command_slots:
            return await super().execute_command(*args, **kwargs)


def cluster_client(
    url: str | ClusterURL, *, max_connections: int = 64, **options: Any
) -> BoundedRedisCluster:
    """A client of the cluster ``url`` (no I/O until its first command).

    ``options`` go to every node connection (``socket_timeout``, ``decode_responses``...);
    URL options ``socket_timeout`` and ``socket_connect_timeout`` (seconds) are applied too.
    """
    parsed = url if isinstance(url, ClusterURL) else ClusterURL.parse(url)
    url_options = dict(parsed.options)
    for name in SECONDS:
        seconds = url_seconds(url_options, name)
        if seconds is not None:
            options[name] = seconds  # the URL's own, as redis-py's from_url does
    return BoundedRedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in parsed.seeds],
        username=parsed.username,
        password=parsed.password,
        max_commands=max_connections,
        **options,
    )


def node_client(cluster: RedisCluster, node: ClusterNode, **options: Any) -> aioredis.Redis:
    """A plain client of one node of ``cluster`` (its credentials), for pub/sub connections.
    It does not reconnect silently: a drop must be seen, or messages go missing unnoticed."""
    kwargs = cluster.get_connection_kwargs()
    return aioredis.Redis(
        host=node.host,
        port=int(node.port),
        username=kwargs.get("username"),
        password=kwargs.get("password"),
        socket_connect_timeout=options.pop("socket_connect_timeout", 5.0),
        decode_responses=False,
        retry=Retry(NoBackoff(), 0),
        **options,
    )


def is_cluster_client(client: Any) -> bool:
    """Whether ``client`` talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


def slot_of(key: str | bytes) -> int:
    """The hash slot of ``key`` (its ``{hash tag}`` if it has one)."""
    return key_slot(key.encode() if isinstance(key, str) else key)


@functools.cache
def slot_tags() -> tuple[str, ...]:
    """For each of the 16384 slots, a short text that hashes to it: ``{tag}`` in a name puts
    the name in that slot (how a readiness channel is placed beside the keys it announces).
    Pure and computed once per process (about 170,000 CRCs: tens of milliseconds)."""
    tags: list[str | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
    missing = REDIS_CLUSTER_HASH_SLOTS
    mask = REDIS_CLUSTER_HASH_SLOTS - 1
    for i in itertools.count():
        text = b"%x" % i
        slot = crc_hqx(text, 0) & mask  # key_slot of a name without braces
        if tags[slot] is None:
            tags[slot] = text.decode()
            missing -= 1
            if not missing:
                break
    return tuple(t for t in tags if t is not None)


async def read_many(client: Any, keys: Sequence[str | bytes]) -> list[Any]:
    """``MGET`` of ``keys`` in order, on one Redis or across a cluster's slots (one MGET per
    slot, all at once; not atomic across slots, which no caller here needs)."""
    if not keys:
        return []
    if not is_cluster_client(client):
        return list(await client.mget(list(keys)))
    by_slot: dict[int, list[int]] = defaultdict(list)
    for i, k in enumerate(keys):
        by_slot[slot_of(k)].append(i)
    groups = list(by_slot.values())
    replies = await asyncio.gather(
        *(client.execute_command("MGET", *(keys[i] for i in group)) for group in groups)
    )
    out: list[Any] = [None] * len(keys)
    for group, values in zip(groups, replies, strict=True):
        for i, v in zip(group, values, strict=True):
            out[i] = v
    return out
