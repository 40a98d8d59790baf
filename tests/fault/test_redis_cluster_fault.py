"""A Redis Cluster master killed with SIGKILL under traffic, on the real pipeline (broker, worker
processes, the embeddings and the status records on a 3-master cluster with one replica each).

Its replica is promoted (the other masters vote it in after ``cluster-node-timeout``); the
requests whose work sat on the dead master either complete (their keys had reached the
replica) or end at once as ``failed`` with ``embedding-lost`` (an embedding or claim-checked
input written just before the kill, not replicated yet: ``input-lost`` for the latter); none
waits out ``EPD_EMBEDDING_WAIT_S``, none hangs; requests sent afterwards complete.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from epd.local_pipeline import LocalRun, local_pipeline
from producers.refusal import Refused
from runtime.settings import Settings
from schemas.topics import Topics
from tests import services as layer
from tests.fault.traffic import figures, outcomes, outcomes_records_may_lose, render_one

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = ("results", "encode", "prefill", "router")
EMBEDDING_WAIT_S = 60.0
END_WITHIN_S = 40.0
"""Longest any request may take to end after the kill (under the embedding wait: a request
that waited it out would have hung as far as its client can tell)."""
LOST = ("embedding-lost", "input-lost")


@pytest.fixture(scope="module")
def failover_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[layer.RedisClusterHandle]:
    try:
        cluster = layer.redis_cluster(tmp_path_factory.mktemp("failover"), 3, replicas=1)
    except layer.ServicesUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings,
    failover_cluster: layer.RedisClusterHandle,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("cluster-fault-logs")
    cfg = settings.model_copy(
        update={
            "redis_url": failover_cluster.url,
            "store_url": failover_cluster.url,
            "embedding_wait_s": EMBEDDING_WAIT_S,
        }
    )
    async with local_pipeline(cfg, spawn_workers=True, log_dir=log_dir, kinds=KINDS) as run:
        yield run


async def _stream(
    run: LocalRun, n: int, *, every_s: float, fault_after: int, fault: Any
) -> tuple[list[str], int]:
    """Like ``stream`` of tests/fault/traffic.py, but a submit the intake refuses as ``unavailable``
    while a master is down (503 with Retry-After at the API) is sent again after a pause, as a
    new request, as a client does. Returns the ids of the requests accepted and how many
    submits were refused."""
    salt, sent, refused, task = str(time.monotonic_ns()), [], 0, None
    for i in range(n):
        if i == fault_after:
            task = asyncio.create_task(fault())
        deadline = time.monotonic() + 30
        while True:
            ev = await render_one(run, 500 + i, salt)
            try:
                if i % 2:
                    await run.submitter.submit_rendered(ev)
                else:  # through the render topic and the router (its fan-out retries itself)
                    await run.publisher.send(
                        Topics(run.settings.topic_prefix).render, ev.request_id, ev
                    )
                break
            except Refused as exc:  # not accepted: the client sends it again, as a new request
                assert exc.kind == "unavailable" and time.monotonic() < deadline, exc
                refused += 1
                await asyncio.sleep(0.5)
        sent.append(ev.request_id)
        await asyncio.sleep(every_s)
    if task is not None:
        await task
    return sent, refused


async def _promoted(cluster: layer.RedisClusterHandle, replica: str, timeout_s: float) -> float:
    """Seconds until ``replica`` reports itself a master."""
    t0 = time.monotonic()
    while layer._role(replica) != "master":
        assert time.monotonic() - t0 < timeout_s, f"{replica} not promoted in {timeout_s}s"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def test_kill_9_a_master_under_traffic(
    pipeline: LocalRun, failover_cluster: layer.RedisClusterHandle
) -> None:
    run, cluster = pipeline, failover_cluster
    assert run.workers is not None
    victim = cluster.masters()[0]
    replica = cluster.replica_of(victim)
    assert replica is not None, "every master has a replica here"
    facts: dict[str, Any] = {}

    async def fault() -> None:
        facts["killed_at"] = time.monotonic()
        facts["killed_ms"] = int(time.time() * 1000)
        cluster.kill(victim)
        facts["promoted_after_s"] = round(await _promoted(cluster, replica, 30.0), 2)

    ids, refused = await _stream(run, 24, every_s=0.25, fault_after=8, fault=fault)
    got = await outcomes(run, ids)
    ended_s = max(
        (rec.get("finished_ms") or 0) / 1000 - facts["killed_ms"] / 1000 for rec in got.values()
    )
    after, _ = await _stream(run, 4, every_s=0.1, fault_after=99, fault=asyncio.sleep)
    later = await outcomes(run, after)
    lost_codes = {
        r: (got[r].get("error") or {}).get("code") for r in ids if got[r]["status"] != "completed"
    }
    fig = figures(
        "kill -9 a Redis Cluster master",
        ids,
        got,
        victim=victim,
        submits_refused_while_down=refused,
        promoted=replica,
        promoted_after_s=facts.get("promoted_after_s"),
        last_ended_after_kill_s=round(ended_s, 2),
        not_completed=lost_codes,
        afterwards_completed=sum(1 for r in after if later[r]["status"] == "completed"),
        masters_now=cluster.masters(),
    )
    run.workers.check_alive()
    assert fig["lost"] == 0, fig  # none hung
    assert all(code in LOST for code in lost_codes.values()), fig
    assert all(got[r]["status"] in ("completed", "failed") for r in ids), fig
    assert ended_s < END_WITHIN_S, fig
    assert replica in cluster.masters() and victim not in cluster.masters()
    assert fig["afterwards_completed"] == len(after), fig  # the rest of the cluster serves


async def test_a_failover_that_lost_the_last_writes_ends_their_requests_as_embedding_lost(
    pipeline: LocalRun, failover_cluster: layer.RedisClusterHandle
) -> None:
    """The replica is frozen and cut off from its master while requests are encoded (so their
    embeddings and marks on that master never reach it), the master is killed and the replica,
    thawed, is promoted without them; the prefill worker was frozen meanwhile, so it starts
    waiting only now. Requests whose embedding went with the master end at once as
    embedding-lost (whether or not their record went too: a record that went is not made
    again, so those outcomes are read from the results topic); the others complete."""
    import os
    import signal
    import uuid

    from media.sample_images import synthetic_image
    from schemas.types import SamplingParams

    run, cluster = pipeline, failover_cluster
    assert run.workers is not None
    victim = next(m for m in cluster.masters() if cluster.replica_of(m) is not None)
    replica = cluster.replica_of(victim)
    assert replica is not None
    salt = uuid.uuid4().hex

    async def submit(seed: int) -> str:
        ev, _ = await run.submitter.submit(
            prompt="Describe <image>.",
            images=[synthetic_image(56, 70, seed=seed)],
            sampling=SamplingParams(max_tokens=3),
            cache_salt=salt,
            request_id=f"lossy-{uuid.uuid4().hex[:10]}",
        )
        return ev.request_id

    warm = await submit(900)  # every worker is up, and has seen the cluster's replicas
    assert (await run.submitter.wait(warm, timeout_s=120)).status == "completed"
    (index,) = run.workers.indices("prefill")
    prefill_pid = run.workers.procs[index][1].pid
    os.kill(prefill_pid, signal.SIGSTOP)
    cluster.signal(replica, signal.SIGSTOP)
    before = cluster.keys_on(victim, "ec-*")
    try:
        assert cluster.cut_replication(victim) == 1
        ids = [await submit(910 + i) for i in range(9)]
        deadline = time.monotonic() + 60
        while True:  # until every item's mark is in its record (on whichever master)
            recs = [await run.submitter.status.get(r) for r in ids]
            if all(r is not None and r.encoded_items() for r in recs):
                break
            assert time.monotonic() < deadline, "items not encoded in 60 s"
            await asyncio.sleep(0.1)
        on_victim = len(cluster.keys_on(victim, "ec-*") - before)
        cluster.kill(victim)
    finally:
        cluster.signal(replica, signal.SIGCONT)
    promoted_s = await _promoted(cluster, replica, 30.0)
    os.kill(prefill_pid, signal.SIGCONT)
    resumed = time.monotonic()
    got = await outcomes_records_may_lose(run, ids)
    ended_s = time.monotonic() - resumed
    codes = {r: (got[r].get("error") or {}).get("code") for r in ids}
    fig = figures(
        "a lossy Redis Cluster failover",
        ids,
        got,
        embeddings_on_the_killed_master=on_victim,
        promoted_after_s=round(promoted_s, 2),
        all_ended_after_resume_s=round(ended_s, 2),
        codes=codes,
    )
    run.workers.check_alive()
    assert fig["lost"] == 0, fig
    assert all(got[r]["status"] == "completed" or codes[r] in LOST for r in ids), fig
    assert on_victim == 0 or any(codes[r] == "embedding-lost" for r in ids), fig
    assert ended_s < END_WITHIN_S, fig
