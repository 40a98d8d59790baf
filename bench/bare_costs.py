"""What the bare operations a request is made of cost in CPU on this machine.

The coordinator benchmark's cells say what the stack spends per request; these say what the
pieces it cannot do without cost here, measured in the same run with the same broker and Redis:
a Kafka hop (a record produced ``acks=all`` and fetched back, the client's and the broker's CPU,
one record at a time and 16 in flight), a Redis round trip (a one-line script, the client's and
the server's CPU) and a wake-up of another process (a one-byte pipe ping-pong between two
processes: the cost every hand-off between processes or threads pays, which a virtual machine
can make several times what it is on bare metal).

None of these is a budget; they are the yardstick the stack's own figures are read against.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

from bench.common import sig
from bench.worker_profile import cpu_seconds

PING_PONG_CHILD = """
import os, sys
r, w = int(sys.argv[1]), int(sys.argv[2])
while os.read(r, 1):
    os.write(w, b"x")
"""
"""The other side of the wake-up measurement: answers each byte with one, until EOF."""


def per_unit(cpu_s: float, count: int, scale: float = 1000.0) -> float:
    """CPU seconds spent on ``count`` operations, per operation (ms by default)."""
    return sig(scale * cpu_s / max(1, count))


async def kafka_hop_cpu(
    settings: Any, broker_pid: int | None, records: int, in_flight: int
) -> dict[str, Any]:
    """CPU per record of ``records`` produced (``acks=all``, the stack's producer settings)
    and fetched back (its consumer settings), ``in_flight`` at a time: the client's (this
    process: producer and consumer) and the broker's, after a warm-up of the same size."""
    from bench.pipeline import _delete_topics, hop_clients

    topic = f"{settings.topic_prefix}.bench-bare-{in_flight}"
    payload = b"r" * 600  # about a PrefillEvent's size
    rounds = max(1, records // in_flight)
    try:
        async with hop_clients(settings, topic, producer_overrides={"linger_ms": 0}) as clients:
            producer, consumer, tp = clients

            async def round_trip() -> None:
                acks = [await producer.send(topic, payload, partition=0) for _ in range(in_flight)]
                await asyncio.gather(*acks)
                got = 0
                while got < in_flight:
                    got += len((await consumer.getmany(tp, timeout_ms=2000)).get(tp, []))

            for _ in range(rounds):  # the warm-up, of the same size
                await round_trip()
            client0, broker0 = time.process_time(), _cpu(broker_pid)
            for _ in range(rounds):
                await round_trip()
            client, broker = time.process_time() - client0, _cpu(broker_pid) - broker0
    finally:
        await _delete_topics(settings, [topic])
    n = rounds * in_flight
    return {
        "records": n,
        "in_flight": in_flight,
        "client_ms": per_unit(client, n),
        "broker_ms": per_unit(broker, n),
        "total_ms": per_unit(client + broker, n),
    }


async def redis_round_trip_cpu(url: str, redis_pid: int | None, n: int) -> dict[str, Any]:
    """CPU per round trip of a one-line script (``EVALSHA`` of a ``SET``), one at a time: the
    client's (redis-py, this process) and the server's."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    key = f"bench-bare-{os.getpid()}"
    try:
        sha = await client.script_load("return redis.call('SET', KEYS[1], ARGV[1], 'EX', 60)")
        for _ in range(max(10, n // 10)):
            await client.evalsha(sha, 1, key, "v")
        ours0, server0 = time.process_time(), _cpu(redis_pid)
        for _ in range(n):
            await client.evalsha(sha, 1, key, "v")
        ours, server = time.process_time() - ours0, _cpu(redis_pid) - server0
        await client.delete(key)
    finally:
        await client.aclose()
    return {
        "round_trips": n,
        "client_ms": per_unit(ours, n),
        "server_ms": per_unit(server, n),
        "total_ms": per_unit(ours + server, n),
    }


def wakeup_cpu(n: int) -> dict[str, Any]:
    """CPU of one process waking another and being woken back (a one-byte pipe ping-pong,
    both sides' CPU), in microseconds per round trip, and its wall time."""
    child_reads, to_child = os.pipe()  # (read end, write end)
    from_child, child_writes = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", PING_PONG_CHILD, str(child_reads), str(child_writes)],
        pass_fds=(child_reads, child_writes),
    )
    os.close(child_reads)
    os.close(child_writes)
    try:
        for _ in range(max(10, n // 10)):
            os.write(to_child, b"x")
            os.read(from_child, 1)
        ours0, theirs0, wall0 = time.process_time(), cpu_seconds(child.pid), time.perf_counter()
        for _ in range(n):
            os.write(to_child, b"x")
            os.read(from_child, 1)
        wall = time.perf_counter() - wall0
        used = time.process_time() - ours0 + cpu_seconds(child.pid) - theirs0
    finally:
        os.close(to_child)  # EOF: the child's loop ends
        child.wait(timeout=10)
        os.close(from_child)
    return {
        "round_trips": n,
        "cpu_us": per_unit(used, n, scale=1e6),
        "wall_us": per_unit(wall, n, scale=1e6),
    }


async def thread_hop_cpu(n: int) -> dict[str, Any]:
    """CPU of the event loop handing a call to a thread and getting its result back, in
    microseconds per round trip: through ``run_in_executor`` on a one-thread pool (what the
    workers' compute used to hop through) and through a :class:`~runtime.thread_lane.ThreadLane`
    (what they hop through now), alternated, best of three each."""
    from concurrent.futures import ThreadPoolExecutor

    from runtime.thread_lane import ThreadLane

    loop = asyncio.get_running_loop()
    pool, lane = ThreadPoolExecutor(1), ThreadLane("bench-hop")

    async def through_pool() -> float:
        t0 = time.process_time()
        for i in range(n):
            await loop.run_in_executor(pool, abs, i)
        return time.process_time() - t0

    async def through_lane() -> float:
        t0 = time.process_time()
        for i in range(n):
            await lane.run(abs, i)
        return time.process_time() - t0

    pooled: list[float] = []
    laned: list[float] = []
    try:
        await through_pool()  # warm: the threads start
        await through_lane()
        for _ in range(3):
            pooled.append(await through_pool())
            laned.append(await through_lane())
    finally:
        pool.shutdown()
        lane.shutdown()
    return {
        "round_trips": n,
        "run_in_executor_cpu_us": per_unit(min(pooled), n, scale=1e6),
        "thread_lane_cpu_us": per_unit(min(laned), n, scale=1e6),
        "lane_vs_executor": sig(min(laned) / min(pooled)),
    }


async def bare_costs(
    settings: Any, pids: dict[str, int], *, records: int, pings: int
) -> dict[str, Any]:
    """The bare operations' CPU on this machine (see the module docstring)."""
    broker = pids.get("broker")
    return {
        "what": "CPU of the bare operations, this machine, this run (not budgets): a Kafka "
        "record produced acks=all and fetched back (client = this process's producer and "
        "consumer), one at a time and 16 in flight; a Redis round trip (EVALSHA of a SET); a "
        "process waking another and being woken back (a pipe ping-pong); the event loop "
        "handing a call to a thread and back (a pool's and a thread lane's)",
        "kafka_hop_one_at_a_time": await kafka_hop_cpu(settings, broker, records, 1),
        "kafka_hop_16_in_flight": await kafka_hop_cpu(settings, broker, records * 4, 16),
        "redis_round_trip": await redis_round_trip_cpu(
            settings.redis_url, pids.get("redis"), pings * 4
        ),
        "process_wakeup_round_trip": await asyncio.to_thread(wakeup_cpu, pings * 10),
        "thread_hop_round_trip": await thread_hop_cpu(pings * 10),
    }


def _cpu(pid: int | None) -> float:
    """CPU seconds of ``pid`` so far (0 without one: a broker or Redis not ours to read)."""
    return cpu_seconds(pid) if pid else 0.0
