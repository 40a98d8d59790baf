"""Does a broker or a Redis answer? Sync probes usable from any thread, with or without a loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

from epd.services.processes import port_open

T = TypeVar("T")


def _run_coro(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from sync code, even when the caller's thread has a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(factory()))  # type: ignore[arg-type]
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="epd-services-probe")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


async def kafka_answers_async(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True when the broker answers a metadata round trip (admin ``list_topics``)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        await asyncio.wait_for(admin.list_topics(), timeout_s)
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


def _bootstrap_reachable(bootstrap: str) -> bool:
    for part in bootstrap.split(","):
        host, _, port = part.strip().rpartition(":")
        with contextlib.suppress(ValueError):
            if port_open(host.strip("[]") or "127.0.0.1", int(port)):
                return True
    return False


def kafka_answers(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """Sync form of :func:`kafka_answers_async`; a closed port is rejected without aiokafka."""
    if not _bootstrap_reachable(bootstrap):
        return False
    return _run_coro(lambda: kafka_answers_async(bootstrap, timeout_s))


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis server at ``url`` answers PING (a ``redis+cluster://`` URL: a seed
    answers and says the cluster is ``ok``)."""
    import redis

    from runtime.redis.cluster import ClusterURL, is_cluster_url

    if is_cluster_url(url):
        return any(_cluster_ok(host, port, timeout_s) for host, port in ClusterURL.parse(url).seeds)
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


def _cluster_ok(host: str, port: int, timeout_s: float) -> bool:
    import redis

    client = redis.Redis(
        host=host, port=port, socket_connect_timeout=timeout_s, socket_timeout=timeout_s
    )
    try:
        info = client.cluster("info")
        state = info.get("cluster_state") if isinstance(info, dict) else None
        return state == "ok"
    except Exception:
        return False
    finally:
        client.close()
