"""Broker faults under a stream of requests, on the real pipeline (broker, Redis, worker processes).

Apache Kafka keeps its log: killed with SIGKILL and restarted on the same log directory, frozen
for 10 s (SIGSTOP, or ``docker pause`` in container mode), or with its consumer groups
rebalancing under load (a second encode worker joins mid-stream, later one leaves), every
accepted request completes, none has two terminal statuses, and no worker exits: they reconnect
and resume. Tansu keeps everything in memory: a restart loses what it held, and the requests in
flight end anyway (``failed`` ``broker-lost`` from the results collector's sweep, or
``expired``), none hangs; requests sent after the restart complete.

Each test prints its figures (the README's Testing section quotes them).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from epd.local_pipeline import LocalRun, local_pipeline
from runtime.settings import Settings
from schemas.types import TERMINAL_STATUSES, now_ms
from tests import services as layer
from tests.fault.traffic import figures, outcomes, render_one, stream, terminal_results

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = ("results", "encode", "prefill", "router")
FREEZE_S = 10.0
RESULTS_WAIT_S = 90.0


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings,
    test_services: layer.TestServices,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[LocalRun]:
    if not test_services.kafka.controllable:
        pytest.skip(f"the broker is not ours to fault in mode {test_services.mode}")
    log_dir: Path = tmp_path_factory.mktemp("broker-fault-logs")
    cfg = settings.model_copy(update={"sweep_interval_s": 1.0})
    if test_services.kafka_is_tansu:
        # A quick sweep, so a request Tansu lost ends within seconds of the restart. (Not for
        # Apache Kafka's freeze: a send held up by the outage would look lost.)
        cfg = cfg.model_copy(update={"sweep_stale_s": 8.0})
    async with local_pipeline(cfg, spawn_workers=True, log_dir=log_dir, kinds=KINDS) as run:
        yield run


def needs(test_services: layer.TestServices, broker: str) -> None:
    if test_services.broker != broker:
        pytest.skip(f"a {broker} fault; the session's broker is {test_services.broker}")


async def duplicates(run: LocalRun, ids: list[str]) -> tuple[int, int]:
    """(requests with two different terminal statuses, requests whose terminal event was sent
    more than once) on the durable results topic."""
    found = await terminal_results(run, ids, RESULTS_WAIT_S)
    distinct = sum(
        1
        for r in ids
        if len({(e.status, e.error.code if e.error else None) for e in found.get(r, [])}) > 1
    )
    resent = sum(1 for r in ids if len(found.get(r, [])) > 1)
    return distinct, resent


async def served_through(
    run: LocalRun,
    name: str,
    fault: Callable[[], Awaitable[None]],
    n: int,
    fault_after: int,
    **extra: object,
) -> dict:
    """A stream of ``n`` requests with ``fault`` running after ``fault_after`` of them: its
    figures, once every worker is found alive and every request completed, none twice."""
    assert run.workers is not None
    t0 = time.monotonic()
    ids = await stream(run, n, every_s=0.25, fault_after=fault_after, fault=fault)
    got = await outcomes(run, ids)
    distinct, resent = await duplicates(run, ids)
    fig = figures(
        name,
        ids,
        got,
        duplicated=distinct,
        terminal_sent_twice=resent,
        seconds=round(time.monotonic() - t0, 1),
        **extra,
    )
    run.workers.check_alive()  # every worker reconnected and resumed; none exited
    assert fig["completed"] == fig["sent"], fig
    assert distinct == 0, fig
    return fig


async def test_kill_9_the_broker_and_restart_it_on_its_log_dir(
    pipeline: LocalRun, test_services: layer.TestServices
) -> None:
    needs(test_services, "apache")
    restart = test_services.kafka.restart
    assert restart is not None
    down: list[float] = []

    async def fault() -> None:
        await asyncio.sleep(0.3)
        t = time.monotonic()
        await asyncio.to_thread(restart, 1.0, hard=True)
        down.append(round(time.monotonic() - t, 1))

    fig = await served_through(
        pipeline, "broker kill -9, restarted on its log dir", fault, 16, 4, down_s=down
    )
    assert down and down[0] > 1.0, fig


async def test_broker_frozen_for_ten_seconds(
    pipeline: LocalRun, test_services: layer.TestServices
) -> None:
    needs(test_services, "apache")
    handle = test_services.kafka
    assert handle.pause is not None and handle.unpause is not None
    pause, unpause = handle.pause, handle.unpause

    async def fault() -> None:
        await asyncio.to_thread(pause)
        try:
            await asyncio.sleep(FREEZE_S)
        finally:
            await asyncio.to_thread(unpause)

    await served_through(pipeline, f"broker frozen {FREEZE_S:g} s", fault, 16, 3)


async def test_an_encode_worker_joins_and_one_leaves_under_load(pipeline: LocalRun) -> None:
    workers = pipeline.workers
    assert workers is not None
    moves: list[str] = []

    async def fault() -> None:
        joined = await workers.add("encode")  # a rebalance of the encode group
        moves.append(f"joined encode-{joined}")
        await asyncio.sleep(2.0)
        leaving = workers.indices("encode")[0]
        code = workers.retire(leaving)  # SIGTERM: it drains, commits and leaves (a rebalance)
        moves.append(f"encode-{leaving} left with {code}")

    fig = await served_through(
        pipeline, "encode group rebalance: one joins, one leaves", fault, 24, 3, moves=moves
    )
    assert moves[-1].endswith("left with 0"), fig


@pytest.mark.tansu
async def test_a_tansu_restart_loses_what_it_held_and_those_requests_end(
    pipeline: LocalRun, test_services: layer.TestServices
) -> None:
    """A burst queues work; Tansu restarts empty under it. Every request still ends, each lost
    one as ``failed`` ``broker-lost`` (or ``expired``), well before its deadline; none hangs,
    and requests sent after the restart complete."""
    needs(test_services, "tansu")
    run, handle = pipeline, test_services.kafka
    assert handle.restart is not None and run.workers is not None
    workers = run.workers
    salt = uuid.uuid4().hex
    deadline_s = 120.0
    burst = [await render_one(run, 700 + i, salt) for i in range(8)]
    for ev in burst:
        ev.deadline_ms = now_ms() + int(deadline_s * 1000)
    # The prefill worker is frozen while the burst goes out, so its events wait in Tansu.
    (prefill,) = workers.indices("prefill")
    prefill_proc = workers.procs[prefill][1]
    prefill_proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        await asyncio.gather(*(run.submitter.submit_rendered(ev) for ev in burst))
        await asyncio.to_thread(handle.restart, 0.5)  # memory storage: all it held is gone
    finally:
        prefill_proc.send_signal(signal.SIGCONT)
    ids = [ev.request_id for ev in burst]
    got = await outcomes(run, ids)
    ended_s = round(time.monotonic() - t0, 1)

    # The workers that found their logs lost make the pipeline's topics again; a record sent
    # to a topic the restarted Tansu has not made yet is acknowledged and then lost.
    topics_back = await topics_made_again(run.settings)
    after = [await render_one(run, 800 + i, salt) for i in range(4)]
    for ev in after:
        await submit_after_restart(run, ev)
    later = await outcomes(run, [ev.request_id for ev in after])

    ends = Counter(
        f"{rec['status']}:{(rec.get('error') or {}).get('code')}" for rec in got.values()
    )
    fig = {
        "fault": "Tansu restarted under a burst",
        "sent": len(ids),
        "ends": dict(ends),
        "hung": sum(1 for rec in got.values() if rec["status"] not in TERMINAL_STATUSES),
        "all_ended_after_s": ended_s,
        "deadline_s": deadline_s,
        "topics_back_after_s": topics_back,
        "sent_after_restart": len(after),
        "completed_after_restart": sum(1 for r in later.values() if r["status"] == "completed"),
        "after_restart": dict(
            Counter(f"{r['status']}:{(r.get('error') or {}).get('code')}" for r in later.values())
        ),
    }
    print(f"\nfault figures: {fig}")
    run.workers.check_alive()
    assert fig["hung"] == 0, fig
    allowed = {"completed:None", "failed:broker-lost", "expired:deadline"}
    assert set(ends) <= allowed, fig
    assert ended_s < deadline_s, fig  # the sweep ended them, not the deadline
    assert fig["completed_after_restart"] == len(after), fig


async def topics_made_again(settings: Settings, timeout_s: float = 30.0) -> float | None:
    """Seconds until every pipeline topic is on the broker again (None: not within
    ``timeout_s``; the sends then rely on the broker's auto-creation and their retries)."""
    from aiokafka.admin import AIOKafkaAdminClient

    from schemas.topics import Topics

    wanted = set(Topics(settings.topic_prefix).all())
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
        try:
            await admin.start()
            if wanted <= set(await admin.list_topics()):
                return round(time.monotonic() - t0, 1)
        except Exception:  # the broker still coming back
            pass
        finally:
            await admin.close()
        await asyncio.sleep(0.25)
    return None


async def submit_after_restart(run: LocalRun, ev: object, tries: int = 20) -> None:
    """Tansu answers the first sends to a topic it re-created with errors: retry, as a client
    that got a 503 would."""
    for attempt in range(tries):
        try:
            await run.submitter.submit_rendered(ev)  # type: ignore[arg-type]
            return
        except Exception:
            if attempt == tries - 1:
                raise
            await asyncio.sleep(0.5)
