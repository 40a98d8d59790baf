"""EPD_KAFKA_TRANSACTIONS on a real Apache Kafka broker: outputs and offsets commit atomically.

The broker is the session's when it is real Kafka, else one Apache Kafka node started from
Maven jars for this module (``tests.services.transactional_kafka``). Without java, mvn and a
reachable Maven registry (or ``EPD_KAFKA_LIBS``) these tests skip and say why.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from runtime.kafka import KafkaPublisher, ensure_topics, make_producer, read_topic
from runtime.settings import Settings
from tests import services as test_services_mod

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 60.0


@pytest.fixture(scope="module")
def txn_settings(
    test_services: test_services_mod.TestServices,
    settings: Settings,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Settings]:
    """Settings pointing at a broker with transactions, EPD_KAFKA_TRANSACTIONS on."""
    try:
        kafka = test_services_mod.transactional_kafka(
            test_services, tmp_path_factory.mktemp("txn-kafka")
        )
    except test_services_mod.ServicesUnavailable as exc:
        pytest.skip(str(exc))
    try:
        yield settings.model_copy(
            update={
                "kafka_bootstrap": kafka.bootstrap,
                "kafka_idempotence": True,
                "kafka_transactions": True,
                "kafka_session_timeout_ms": 10000,
                "kafka_heartbeat_interval_ms": 3000,
            }
        )
    finally:
        kafka.close()


@pytest.fixture
async def pair(txn_settings: Settings) -> AsyncIterator[tuple[str, str]]:
    """A fresh one-partition input topic and output topic."""
    name = f"txn-{uuid.uuid4().hex[:8]}"
    src, out = f"{name}.in", f"{name}.out"
    await ensure_topics(txn_settings, [src, out, f"{src}.dlq"], partitions=1)
    yield src, out


def _worker(settings: Settings, src: str, out: str, group: str, marker: Path, *, hang: bool):
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(ROOT)}
    env["EPD_TEST_HANG"] = "1" if hang else "0"
    cmd = [sys.executable, "-m", "tests.integration.txn_worker", src, out, group, str(marker)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env)


def _results_worker(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "epd.cli", "worker", "results"], cwd=ROOT, env=env
    )


async def _produce(settings: Settings, topic: str, values: list[bytes]) -> None:
    """The inputs, each keyed by itself, one at a time (one partition: in this order)."""
    producer = make_producer(settings)
    await producer.start()
    try:
        for v in values:
            await producer.send_and_wait(topic, value=v, key=v)
    finally:
        await producer.stop()


async def _until_hung(worker: subprocess.Popen[bytes], marker: Path) -> None:
    """Until ``worker`` has sent the hanging record's output and hangs (its marker exists)."""
    deadline = time.monotonic() + WAIT_S
    while not await asyncio.to_thread(marker.exists):
        assert worker.poll() is None, "the worker died before reaching the hanging record"
        assert time.monotonic() < deadline, "the worker never reached the hanging record"
        await asyncio.sleep(0.1)


async def _committed_outputs(settings: Settings, topic: str) -> list[bytes]:
    records = await read_topic(settings, topic)  # read_committed: EPD_KAFKA_TRANSACTIONS is on
    return [r.value for r in records]


async def test_a_killed_batch_leaves_no_outputs_and_a_restart_gives_exactly_one_each(
    txn_settings: Settings, pair: tuple[str, str], tmp_path: Path
) -> None:
    src, out = pair
    group = f"g-{uuid.uuid4().hex[:8]}"
    settings = txn_settings.model_copy(update={"kafka_transactional_id": f"w-{group}"})
    values = (
        [f"v{i}".encode() for i in range(20)] + [b"hang"] + [f"w{i}".encode() for i in range(5)]
    )
    await _produce(settings, src, values)
    marker = tmp_path / "hang-sent"
    first = _worker(settings, src, out, group, marker, hang=True)
    await _until_hung(first, marker)
    os.kill(first.pid, signal.SIGKILL)  # mid-transaction: outputs sent, nothing committed
    first.wait()

    seen = await _committed_outputs(settings, out)
    assert b"hang" not in seen, "an output of an uncommitted batch is visible to read_committed"
    print(f"\ntransactions: {len(seen)} outputs committed before the kill")

    second = _worker(settings, src, out, group, marker, hang=False)  # same id: fences the zombie
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            seen = await _committed_outputs(settings, out)
            if len(seen) >= len(values) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    finally:
        second.send_signal(signal.SIGTERM)
        second.wait(timeout=30)
    counts = Counter(seen)
    print(f"transactions: {len(seen)} committed outputs for {len(values)} inputs")
    assert set(counts) == set(values)
    assert max(counts.values()) == 1, f"duplicated: {[v for v, n in counts.items() if n > 1]}"


async def test_a_zombie_with_the_same_transactional_id_is_fenced(
    txn_settings: Settings, pair: tuple[str, str], tmp_path: Path
) -> None:
    """A worker stalls mid-batch (alive: a GC pause, a frozen VM); its successor starts with the
    same transactional id. The successor's start fences the stalled one and aborts its open
    transaction; when the stalled one wakes, its commit is refused and it stops. Readers see
    each input's output exactly once, none of the zombie's batch."""
    src, out = pair
    group = f"g-{uuid.uuid4().hex[:8]}"
    settings = txn_settings.model_copy(update={"kafka_transactional_id": f"w-{group}"})
    values = (
        [f"v{i}".encode() for i in range(10)] + [b"hang"] + [f"w{i}".encode() for i in range(5)]
    )
    await _produce(settings, src, values)
    marker = tmp_path / "hang-sent"
    zombie = _worker(settings, src, out, group, marker, hang=True)
    successor = None
    try:
        await _until_hung(zombie, marker)
        successor = _worker(settings, src, out, group, tmp_path / "unused", hang=False)
        seen: list[bytes] = []
        deadline = time.monotonic() + WAIT_S
        while len(seen) < len(values) and time.monotonic() < deadline:
            seen = await _committed_outputs(settings, out)
            await asyncio.sleep(0.5)
        marker.with_name(marker.name + ".release").write_text("go\n")  # the zombie wakes
        zombie_code = zombie.wait(timeout=60)
        await asyncio.sleep(2.0)  # anything the zombie could still commit would be visible now
        seen = await _committed_outputs(settings, out)
    finally:
        for proc in (zombie, successor):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    counts = Counter(seen)
    print(f"\ntransactions: zombie exited with {zombie_code}; {len(seen)} outputs committed")
    assert set(counts) == set(values)
    assert max(counts.values()) == 1, f"duplicated: {[v for v, n in counts.items() if n > 1]}"
    assert zombie_code != 0, "the fenced worker kept running as if it owned the id"


async def test_results_stage_runs_transactionally_end_to_end(
    txn_settings: Settings, topics: object, redis_client: object, redis_prefix: str
) -> None:
    from runtime.status import StatusStore
    from schemas.topics import Topics
    from schemas.types import ResultEvent

    t: Topics = topics  # type: ignore[assignment]
    settings = txn_settings.model_copy(update={"topic_prefix": t.prefix})
    await ensure_topics(settings, t.all())
    env = {**os.environ, **settings.to_env(), "PYTHONPATH": str(ROOT)}
    proc = _results_worker(env)
    store = StatusStore(redis_client, prefix=t.prefix)  # type: ignore[arg-type]
    rid = f"req-{uuid.uuid4().hex[:8]}"
    producer = make_producer(settings)
    await producer.start()
    try:
        await store.create(rid, {"status": "queued"})
        await KafkaPublisher(producer).send(
            t.results, rid, ResultEvent(rid, "prefill", "completed")
        )
        await producer.send_and_wait(t.results, value=b"not an event", key=rid.encode())
        deadline = time.monotonic() + WAIT_S
        rec = None
        while time.monotonic() < deadline:
            rec = await store.get(rid)
            if rec is not None and rec.status == "completed":
                break
            assert proc.poll() is None, "the results worker exited"
            await asyncio.sleep(0.2)
        assert rec is not None and rec.status == "completed", rec
        dlq: list = []
        while time.monotonic() < deadline and not dlq:
            dlq = await read_topic(settings, t.dlq)  # committed with its batch's transaction
            await asyncio.sleep(0.2)
        assert len(dlq) == 1
    finally:
        await producer.stop()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
