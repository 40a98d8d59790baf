"""The two embedded brokers side by side: start-up time, idle memory and idle CPU.

For each broker that can run here (Apache Kafka 4.4 from its jars, Tansu; ``epd.services``
starts them as ``epd up`` does): ``starts`` cold starts on a fresh data directory, each timed
from spawn to the first answered metadata request (Apache Kafka's include its storage format,
as a first ``epd up`` does; the jars are resolved before the clock starts); then, on the last
one, its resident memory once settled, its CPU over ``idle_s`` with no client, and its CPU and
the clients' with the pipeline's four consumers attached and idle as an idle consume loop fetches
(``consumers.idle``: ``EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS`` as ``epd up`` sets it: 250 ms for
Tansu, which answers a waiting fetch only when the wait ends; 5 s for Apache Kafka, which answers
as soon as a record lands; a poll every second, aiokafka's fetch routine woken by its fetches).
Apache Kafka runs with ``EPD_KAFKA_JVM_PROFILE`` (the benchmarks ask for ``production``).

Not a budget: the figures behind the README's choice of default broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Stats, sig
from bench.worker_profile import cpu_seconds, rss_mb

CONSUMERS = 4
"""The pipeline's idle consumers: encode, prefill, router, results (which reads two topics)."""


def _cpu_pct(pids: list[int], seconds: float) -> float:
    """% of one core ``pids`` used together over the next ``seconds``."""
    before = sum(cpu_seconds(p) for p in pids)
    time.sleep(seconds)
    return 100 * (sum(cpu_seconds(p) for p in pids) - before) / seconds


async def _idle_consumers(
    bootstrap: str, fetch_wait_ms: int, seconds: float, settle_s: float = 2.0
) -> float:
    """CPU % of this process while ``CONSUMERS`` consumers poll an empty topic each."""
    import os

    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    names = [f"idle-{i}-{os.getpid()}" for i in range(CONSUMERS)]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    with contextlib.suppress(Exception):
        await admin.create_topics([NewTopic(n, 1, 1) for n in names])
    from consumers.config import ConsumerConfig
    from runtime.kafka import FETCHER_TIMEOUT_MS

    consumers = [
        AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            fetch_max_wait_ms=fetch_wait_ms,
            consumer_timeout_ms=FETCHER_TIMEOUT_MS,
        )
        for _ in names
    ]
    poll_ms = ConsumerConfig(topics=names, group_id="idle", dlq_topic="idle").idle_poll_timeout_ms
    stop = asyncio.Event()

    async def poll(c: AIOKafkaConsumer, topic: str) -> None:
        await c.start()
        c.assign([TopicPartition(topic, 0)])
        while not stop.is_set():
            await c.getmany(timeout_ms=poll_ms)

    tasks = [asyncio.create_task(poll(c, n)) for c, n in zip(consumers, names, strict=True)]
    try:
        await asyncio.sleep(settle_s)  # settled into idle fetches
        before = time.process_time()
        await asyncio.sleep(seconds)
        return 100 * (time.process_time() - before) / seconds
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in consumers:
            with contextlib.suppress(Exception):
                await c.stop()
        with contextlib.suppress(Exception):
            await admin.delete_topics(names)
        await admin.close()


def _one_broker(
    kind: str, starts: int, idle_s: float, work: Path, settle_s: float = 3.0
) -> dict[str, Any]:
    from epd import services
    from epd.services.config import LocalServices
    from runtime.settings import Settings

    env = services.services_env(services.ServiceRecord("kafka", "", False), "", kind)
    # What a stack of this broker runs with: its env lines, else the setting's own default
    # (not this process's environment, which a test run for the other broker may have set).
    default_wait = Settings.model_fields["kafka_idle_fetch_max_wait_ms"].default
    fetch_wait = int(env.get("EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS", default_wait))
    times: list[float] = []
    rec = None
    for i in range(starts):
        node = work / f"{kind}-{i}"
        t0 = time.perf_counter()
        rec = services.start_broker(kind, node, log_dir=node, tie_to_parent=True, fresh=True)
        times.append(time.perf_counter() - t0)
        if i < starts - 1:
            services.stop_records([rec])
    assert rec is not None and rec.pid is not None
    try:
        time.sleep(settle_s)  # settled
        rss = rss_mb(rec.pid) or 0.0
        alone = _cpu_pct([rec.pid], idle_s)
        broker_before = cpu_seconds(rec.pid)
        consumers_settle_s = min(settle_s, 2.0)
        clients = asyncio.run(_idle_consumers(rec.address, fetch_wait, idle_s, consumers_settle_s))
        broker_with = 100 * (cpu_seconds(rec.pid) - broker_before) / (idle_s + consumers_settle_s)
    finally:
        services.stop_records([rec])
    return {
        "version": services.describe(kind),
        **({"jvm_profile": LocalServices().kafka_jvm_profile} if kind == "apache" else {}),
        "start_s": Stats(times).to_json("s"),
        "idle_rss_mb": sig(rss),
        "idle_cpu_pct_no_clients": sig(alone),
        "idle_fetch_max_wait_ms": fetch_wait,
        "idle_cpu_pct_with_pipeline_consumers": {
            "broker": sig(broker_with),
            "clients": sig(clients),
            "consumers": CONSUMERS,
        },
    }


def run(*, quick: bool = False, out: Path | None = None, redis_url: str | None = None) -> dict:
    """Start each available broker ``starts`` times and measure it idle (see the module doc)."""
    from epd import services
    from epd.services import kafka

    # quick: one start, a second to settle and a second idle (a smoke run, the CPU shares round)
    starts, idle_s, settle_s = (1, 1.0, 1.0) if quick else (3, 10.0, 3.0)
    brokers: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    reason = kafka.unavailable_reason()
    if reason is None:
        kafka.resolve_jars()  # once, before any clock: a first run fetches them (seconds)
    with tempfile.TemporaryDirectory(prefix="bench-brokers-") as tmp:
        for kind in services.BROKERS:
            if kind == "apache" and reason is not None:
                skipped[kind] = reason
                continue
            brokers[kind] = _one_broker(kind, starts, idle_s, Path(tmp), settle_s)
    return {
        "what": "embedded brokers as epd up starts them: cold start to first metadata answer "
        "(fresh data directory), idle RSS, idle CPU (% of one core) alone and with the "
        f"pipeline's {CONSUMERS} consumers polling as idle consume loops do (the idle fetch wait)",
        "brokers": brokers,
        "skipped": skipped,
    }
