"""Status folding (pure) and the Redis-backed status store: every store test runs on one real
Redis and on a real 3-master Redis Cluster (``redis_cluster``), where a request's keys share
its hash tag and the in-flight set is another slot's."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from runtime.status import StatusGone, StatusNotifier, StatusStore
from schemas.status_record import fold
from schemas.types import ErrorInfo, ResultEvent


def test_status_moves_forward_only() -> None:
    rec = fold(None, ResultEvent("r", "fanout", "encoding"))
    assert rec is not None and rec.status == "encoding"
    rec = fold(rec, ResultEvent("r", "api", "queued"))  # late, lower rank
    assert rec is not None and rec.status == "encoding"
    rec = fold(rec, ResultEvent("r", "prefill", "prefilling", timings={"wait": 3.0}))
    assert rec is not None and rec.status == "prefilling" and rec.timings["wait"] == 3.0


def test_first_terminal_wins_and_duplicates_are_dropped() -> None:
    done = ResultEvent("r", "prefill", "completed", token_ids=[1, 2], text="ab")
    rec = fold(None, done)
    assert rec is not None and rec.status == "completed" and rec.token_ids == [1, 2]
    assert fold(rec, done) is None  # redelivery
    err = ErrorInfo("failed", "late failure")
    rec2 = fold(rec, ResultEvent("r", "encode", "failed", error=err))
    assert rec2 is not None and rec2.status == "completed" and rec2.error is None


def test_rejection_keeps_rule_and_item() -> None:
    err = ErrorInfo("rejected", "no ec entry", "ec-transfer-required", "image", 1, None)
    rec = fold(None, ResultEvent("r", "prefill", "rejected", error=err))
    assert rec is not None
    assert rec.error["rule"] == "ec-transfer-required" and rec.error["item"] == 1


@pytest.fixture(params=["redis", "cluster"])
async def store(request: pytest.FixtureRequest):
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    if request.param == "cluster":
        from runtime.redis.cluster import cluster_client

        cluster = request.getfixturevalue("redis_cluster")
        client = cluster_client(cluster.url, max_connections=16)
        yield StatusStore(client, prefix=prefix, ttl_s=60)
        await client.aclose()
        cluster.delete(f"{prefix}:*")
        return
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/13")
    yield StatusStore(client, prefix=prefix, ttl_s=60)
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_store_applies_and_dedupes(store: StatusStore) -> None:
    assert await store.get("r1") is None
    assert await store.start(ResultEvent("r1", "api", "queued"))
    assert await store.apply(ResultEvent("r1", "prefill", "completed", token_ids=[7]))
    assert not await store.apply(ResultEvent("r1", "prefill", "completed", token_ids=[7]))
    rec = await store.get("r1")
    assert rec is not None and rec.status == "completed" and rec.token_ids == [7]
    assert 0 < await store.client.ttl(store.keys.status("r1")) <= 60


async def test_concurrent_writers_lose_nothing(store: StatusStore) -> None:
    events = [
        ResultEvent("r2", f"stage{i}", "encoding", timings={f"t{i}": float(i)}) for i in range(20)
    ]
    assert await store.create("r2", {})
    await asyncio.gather(*(store.apply(e) for e in events))
    rec = await store.get("r2")
    assert rec is not None and len(rec.timings) == 20 and len(rec.stages) == 21


def test_encoded_events_mark_each_item_of_a_request() -> None:
    """Each EncodedEvent lands once per item: hits and misses both show in the record."""
    from consumers.results import encoded_update
    from schemas.types import EncodedEvent

    a = EncodedEvent("a" * 64, "r", "tiny", "redis://", "ec:fp:a", "float32", [4, 8], encode_ms=7)
    b = EncodedEvent("b" * 64, "r", "tiny", "redis://", "ec:fp:b", "float32", [], cache_hit=True)
    rec = fold(fold(None, ResultEvent("r", "fanout", "encoding")), encoded_update(a))
    rec = fold(rec, encoded_update(b))
    assert rec is not None
    assert rec.info == {"encoded." + "a" * 12: "encoded", "encoded." + "b" * 12: "cache_hit"}
    assert rec.timings == {"encode." + "a" * 12: 7.0}
    assert fold(rec, encoded_update(a)) is None  # a redelivered EncodedEvent changes nothing


def test_second_item_of_a_stage_is_kept_redelivery_is_not() -> None:
    first = ResultEvent("r", "encode", "encoding", timings={"encode.image0": 5.0})
    second = ResultEvent("r", "encode", "encoding", timings={"encode.image1": 7.0})
    rec = fold(None, first)
    rec = fold(rec, second)
    assert rec is not None and rec.timings == {"encode.image0": 5.0, "encode.image1": 7.0}
    assert "encode:encoding" in rec.stages_last
    assert fold(rec, second) is None


def test_decoding_sits_between_prefilling_and_terminal() -> None:
    rec = fold(None, ResultEvent("r", "prefill", "decoding"))
    assert rec is not None and rec.status == "decoding"
    assert fold(rec, ResultEvent("r", "prefill", "prefilling")).status == "decoding"
    rec = fold(rec, ResultEvent("r", "prefill", "completed", token_ids=[1]))
    assert rec is not None and rec.status == "completed"


async def test_status_changes_are_streamed_and_announced(store: StatusStore) -> None:
    from runtime.status import StatusNotifier

    notifier = StatusNotifier(store)
    await notifier.start()
    try:
        assert await store.create("r2", {"tenant": "t"})
        assert not await store.create("r2", {"tenant": "other"})  # never overwritten
        waiter = asyncio.create_task(notifier.wait_change("r2", "queued", 30))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await store.apply(ResultEvent("r2", "fanout", "encoding"))
        rec = await asyncio.wait_for(waiter, 5)  # woken by the notification, not the timeout
        assert rec is not None and rec.status == "encoding" and rec.tenant == "t"
        # info without a status change: no new event
        await store.apply(ResultEvent("r2", "encode", "encoding", info={"x": "1"}))
        await store.apply(ResultEvent("r2", "prefill", "completed", token_ids=[3]))
        events = await store.events("r2")
        assert [e["status"] for _, e in events] == ["queued", "encoding", "completed"]
        assert events[-1][1]["token_ids"] == [3]
        after_first = await store.events("r2", events[0][0])
        assert [sid for sid, _ in after_first] == [sid for sid, _ in events[1:]]
        # a terminal record answers at once
        t0 = asyncio.get_running_loop().time()
        await notifier.wait_change("r2", "completed", 10)
        assert asyncio.get_running_loop().time() - t0 < 1
    finally:
        await notifier.close()


async def test_a_wait_until_done_sleeps_through_every_stage_to_the_end(
    store: StatusStore,
) -> None:
    from runtime.status import StatusNotifier

    notifier = StatusNotifier(store)
    await notifier.start()
    try:
        assert await store.create("r3", {"tenant": "t"})
        waiter = asyncio.create_task(notifier.wait_change("r3", "queued", 30, until_done=True))
        for status in ("encoding", "prefilling", "decoding"):
            await store.apply(ResultEvent("r3", "prefill", status))
            await asyncio.sleep(0.05)
            assert not waiter.done(), status  # a change that is not the end wakes nobody up
        await store.apply(ResultEvent("r3", "prefill", "completed", token_ids=[1]))
        rec = await asyncio.wait_for(waiter, 5)
        assert rec is not None and rec.status == "completed"
        # the wait still runs out as a plain one does, with the record as it is
        assert await store.create("r4", {"tenant": "t"})
        rec = await notifier.wait_change("r4", "queued", 0.2, until_done=True)
        assert rec is not None and rec.status == "queued"
    finally:
        await notifier.close()


async def test_a_create_with_the_fan_outs_update_writes_both_in_one_run(
    store: StatusStore,
) -> None:
    """The intake's record and the fan-out's first update: one script run, two stream entries
    (queued, then the update's status, each with its stage), the update's record fields set;
    a record already there keeps its owner and takes the update as any update would."""
    client = store.client
    calls = (await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    update = ResultEvent("c1", "fanout", "prefilling")
    assert await store.create("c1", {"tenant": "t"}, first=update, first_fields={"cached": ["h"]})
    after = (await client.info("commandstats")).get("cmdstat_evalsha", {}).get("calls", 0)
    if not store.cluster:  # a cluster's INFO is per node
        assert after - calls == 1
    rec = await store.get("c1")
    assert rec is not None and rec.status == "prefilling" and rec.tenant == "t"
    assert rec.fields["cached"] == ["h"] and "api:queued" in rec.stages
    events = await store.events("c1")
    assert [(e["status"], e["stage"]) for _, e in events] == [
        ("queued", "api"),
        ("prefilling", "fanout"),
    ]
    assert await store.create("c2", {"tenant": "owner"})
    assert await store.create(
        "c2", {"tenant": "other"}, first=ResultEvent("c2", "fanout", "encoding")
    )
    rec = await store.get("c2")
    assert rec is not None and rec.tenant == "owner" and rec.status == "encoding"
    assert not await store.create(
        "c2", {"tenant": "other"}, first=ResultEvent("c2", "fanout", "encoding")
    )


async def test_an_update_sets_record_fields_in_the_same_write(store: StatusStore) -> None:
    # The fan-out's update carries which items were cache hits: one script run, not two.
    assert await store.create("f1", {"tenant": "t"})
    assert await store.apply(ResultEvent("f1", "fanout", "prefilling"), fields={"cached": ["h"]})
    rec = await store.get("f1")
    assert rec is not None and rec.status == "prefilling" and rec.cached == ["h"]
    events = await store.events("f1")
    assert [e["status"] for _, e in events] == ["queued", "prefilling"]
    # The same update again with the same fields changes nothing; with new fields, only them.
    dup = ResultEvent("f1", "fanout", "prefilling")
    assert not await store.apply(dup, fields={"cached": ["h"]})
    assert await store.apply(dup, fields={"cached": []})
    rec = await store.get("f1")
    assert rec is not None and rec.cached == [] and rec.status == "prefilling"
    assert len(await store.events("f1")) == 2  # no status change, no event


async def test_in_flight_bound_is_shared_and_released_on_outcome(store: StatusStore) -> None:
    assert await store.admit("a", 2) and await store.admit("b", 2)
    assert not await store.admit("c", 2)
    await store.create("a", {})
    await store.apply(ResultEvent("a", "prefill", "failed"))
    assert await store.in_flight() == 1
    assert await store.admit("c", 2)
    await store.release("c")
    assert await store.in_flight() == 1
    await store.create("b", {})
    await store.apply(ResultEvent("b", "prefill", "decoding"))
    assert await store.in_flight_by_status() == {"decoding": 1}


async def test_cancel_is_terminal_and_seen_by_workers(store: StatusStore) -> None:
    from runtime.status import CancelWatch

    watch = CancelWatch(store.client, store.prefix)
    await watch.start()
    try:
        await store.create("c1", {})
        assert not await watch.is_cancelled("c1")
        waiter = asyncio.create_task(watch.wait("c1"))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        assert await store.cancel("c1")
        await asyncio.wait_for(waiter, 2)  # woken by the announcement
        for _ in range(100):  # the pub/sub message reaches the watcher's set
            if watch.cancelled_now("c1"):
                break
            await asyncio.sleep(0.01)
        assert watch.cancelled_now("c1") and await watch.is_cancelled("c1")
        await asyncio.wait_for(watch.wait("c1"), 1)  # seen already: returns at once
        await store.apply(ResultEvent("c1", "prefill", "completed", token_ids=[1]))
        rec = await store.get("c1")
        assert rec is not None and rec.status == "cancelled" and rec.token_ids is None
    finally:
        await watch.close()
    # a worker started after the cancel still sees it (the flag in Redis)
    late = CancelWatch(store.client, store.prefix)
    assert await late.is_cancelled("c1") and not late.cancelled_now("other")


async def test_collector_applies_one_requests_updates_in_arrival_order(
    store: StatusStore,
) -> None:
    from consumers.results import ResultsCollector

    rc = ResultsCollector(store)
    assert await store.create("o1", {})
    # dispatched together, as the consume loop does with one fetched batch
    await asyncio.gather(
        rc.handle(ResultEvent("o1", "prefill", "prefilling")),
        rc.handle(ResultEvent("o1", "prefill", "decoding")),
        rc.handle(ResultEvent("o1", "prefill", "completed", token_ids=[1])),
    )
    history = [e["status"] for _, e in await store.events("o1")]
    assert history == ["queued", "prefilling", "decoding", "completed"]
    assert rc.applied == 3 and not rc._order  # nothing kept once a request is idle


async def test_a_stale_memory_of_the_record_loses_no_update(store: StatusStore) -> None:
    """Two writers (a worker and the collector, say), each remembering its own last sight of
    the record: the compare-and-set refuses the stale one, which folds again on Redis's."""
    other = StatusStore(store.client, prefix=store.prefix, ttl_s=60)
    assert await store.start(ResultEvent("s1", "api", "queued"))
    assert await other.apply(ResultEvent("s1", "fanout", "encoding", timings={"fanout": 1.0}))
    # ``store`` still remembers the queued record
    assert await store.apply(ResultEvent("s1", "prefill", "prefilling", timings={"q": 2.0}))
    rec = await store.get("s1")
    assert rec is not None and rec.status == "prefilling"
    assert set(rec.stages) == {"api:queued", "fanout:encoding", "prefill:prefilling"}
    assert rec.timings == {"fanout": 1.0, "q": 2.0}
    events = await store.events("s1")
    assert [e["status"] for _, e in events] == ["queued", "encoding", "prefilling"]
    # the duplicate ``other`` now sends is seen as one against Redis, not its memory
    assert not await other.apply(ResultEvent("s1", "prefill", "prefilling", timings={"q": 2.0}))


async def test_an_update_never_makes_a_record_that_went(store: StatusStore) -> None:
    """A record deleted after a writer last saw it (its TTL, an eviction, an operator, a Redis
    restart) is not made again by an update, whichever path the update takes: the writer's
    remembered text (the compare-and-set finds no record), a fresh read, a field merge, a
    cancel, the sweep's judged outcome or the results collector's fold. Each leaves no key
    behind; the update raises StatusGone (the collector counts it) and announces a change, so
    a reader following the request looks again."""
    from consumers.results import ResultsCollector
    from runtime.status import StatusGone

    rid = f"g-{uuid.uuid4().hex[:8]}"
    assert await store.admit(rid, 1000)
    assert await store.create(rid, {"tenant": "alice", "front": {"model": "m"}})
    assert await store.apply(ResultEvent(rid, "prefill", "decoding"))
    seen = await store.get(rid)
    assert seen is not None and seen.updated_ms is not None
    await store.client.delete(store.keys.status(rid))  # as the TTL or an operator would
    fresh = StatusStore(store.client, prefix=store.prefix, ttl_s=60)  # remembers nothing
    done = ResultEvent(rid, "prefill", "completed", token_ids=[5])
    notifier = StatusNotifier(store)  # what the API's readers wait on
    await notifier.start()
    try:
        async with notifier.watch(rid) as changed:
            for writer in (store, fresh):  # the remembered text; a fresh read
                changed.clear()
                with pytest.raises(StatusGone):
                    await writer.apply(done)
                await asyncio.wait_for(changed.wait(), 5)  # a follower looks again
    finally:
        await notifier.close()
    with pytest.raises(StatusGone):
        await store.update_fields(rid, {"cached": []})
    assert not await store.cancel(rid)
    assert not await store.end_if_unchanged(done, seen.updated_ms)
    rc = ResultsCollector(fresh)
    await rc.handle(done)
    assert (rc.applied, rc.duplicates, rc.gone) == (0, 0, 1)
    assert await store.client.exists(store.keys.status(rid)) == 0
    assert await store.get(rid) is None
    # Its outcome, refused, still gave its in-flight slot back (nothing else would).
    assert rid not in {m.decode() for m in await store.client.zrange(store.keys.inflight, 0, -1)}


async def test_the_sweep_drops_in_flight_entries_whose_record_went(store: StatusStore) -> None:
    """An entry whose record went (no outcome will release it) is dropped once older than
    the cut; a young one without a record (being made) stays."""
    from schemas.types import now_ms

    old, young = f"o-{uuid.uuid4().hex[:8]}", f"y-{uuid.uuid4().hex[:8]}"
    await store.client.zadd(store.keys.inflight, {old: now_ms() - 120_000, young: now_ms()})
    assert await store.inflight.unfinished(100, orphaned_before_ms=now_ms() - 60_000) == []
    left = {m.decode() for m in await store.client.zrange(store.keys.inflight, 0, -1)}
    assert young in left and old not in left


async def test_a_record_deleted_between_the_read_and_the_write_is_not_made_again(
    store: StatusStore,
) -> None:
    """The compare-and-set itself checks existence: an update that read the record and lost
    it before its script ran writes nothing (the script compares with the text it read)."""
    from consumers.results import ResultsCollector
    from runtime.status import StatusGone
    from schemas.status_record import fanout_info

    rid = f"h-{uuid.uuid4().hex[:8]}"
    assert await store.create(rid, {"tenant": "bob"})
    real_write = store._write

    async def deleted_first(*args: object, **kwargs: object) -> tuple[bool, str | None]:
        await store.client.delete(store.keys.status(rid))
        return await real_write(*args, **kwargs)  # type: ignore[arg-type]

    store._write = deleted_first  # type: ignore[method-assign]
    try:
        with pytest.raises(StatusGone):
            await store.apply(ResultEvent(rid, "prefill", "completed", token_ids=[1]))
    finally:
        del store._write
    assert await store.client.exists(store.keys.status(rid)) == 0
    # The entry points still make records: the intake's create, the router's dead letters
    # (start) and the router's fan-out update (marked routed), wherever it is folded; the
    # same update behind the intake (unmarked) makes none.
    assert await store.create(rid, {"tenant": "bob"})
    other = f"h-{uuid.uuid4().hex[:8]}"
    assert await store.start(ResultEvent(other, "fanout", "rejected"))
    assert (await store.get(other)) is not None
    info = fanout_info(encode_events=1, deadline_ms=None)
    unrouted = ResultEvent(f"h-{uuid.uuid4().hex[:8]}", "fanout", "encoding", info=info)
    with pytest.raises(StatusGone):
        await store.apply(unrouted)
    routed_info = fanout_info(encode_events=1, deadline_ms=None, routed=True)
    written = ResultEvent(f"h-{uuid.uuid4().hex[:8]}", "fanout", "encoding", info=routed_info)
    assert await store.apply(written)  # the router's write-through
    folded = ResultEvent(f"h-{uuid.uuid4().hex[:8]}", "fanout", "encoding", info=routed_info)
    await ResultsCollector(store).handle(folded)  # its write-through failed: the collector's
    for ev in (written, folded):
        rec = await store.get(ev.request_id)
        assert rec is not None and rec.status == "encoding"


async def test_an_update_of_a_known_record_is_one_round_trip(store: StatusStore) -> None:
    calls: list[str] = []
    real = store.client.execute_command

    async def counting(*args: object, **kwargs: object) -> object:
        calls.append(str(args[0]))
        return await real(*args, **kwargs)

    assert await store.admit("s3", 10)
    assert await store.start(ResultEvent("s3", "api", "queued"))
    store.client.execute_command = counting  # type: ignore[method-assign]
    try:
        assert await store.apply(ResultEvent("s3", "fanout", "encoding"))
        assert await store.apply(ResultEvent("s3", "prefill", "completed", token_ids=[1]))
    finally:
        del store.client.execute_command
    # No WATCH, GET, MULTI, EXEC; on a cluster the outcome also leaves the in-flight set,
    # which lives in another slot than the record.
    assert calls == (["EVALSHA", "EVALSHA", "ZREM"] if store.cluster else ["EVALSHA", "EVALSHA"])
    events = await store.events("s3")
    assert [e["status"] for _, e in events] == ["queued", "encoding", "completed"]
    assert await store.in_flight() == 0  # the outcome released the request's slot


async def test_every_unfinished_request_is_in_flight_whoever_wrote_it(store: StatusStore) -> None:
    """A record a router or a submitter wrote (no admission) is in the in-flight set too, until
    its outcome: the sweep must see every request that could still hang."""
    rid = f"r-{uuid.uuid4().hex[:8]}"
    assert await store.start(ResultEvent(rid, "fanout", "encoding"))
    assert rid in {m.decode() for m in await store.client.zrange(store.keys.inflight, 0, -1)}
    assert await store.apply(ResultEvent(rid, "prefill", "completed", token_ids=[1]))
    assert rid not in {m.decode() for m in await store.client.zrange(store.keys.inflight, 0, -1)}


async def test_a_judged_outcome_lands_only_on_the_record_as_judged(store: StatusStore) -> None:
    """The sweep's outcome: written only while the record is unfinished and unchanged since the
    sweep read it, so neither a stage's progress nor its outcome is overridden twice."""
    rid = f"r-{uuid.uuid4().hex[:8]}"
    lost = ResultEvent(rid, "sweep", "failed", error=ErrorInfo("broker-lost", "gone"))
    await store.start(ResultEvent(rid, "fanout", "prefilling"))
    first = await store.get(rid)
    assert first is not None and first.updated_ms is not None
    seen = first.updated_ms
    await asyncio.sleep(0.002)
    await store.apply(ResultEvent(rid, "prefill", "decoding"))  # moved on after the read
    assert not await store.end_if_unchanged(lost, seen)
    now = await store.get(rid)
    assert now is not None and now.status == "decoding" and now.updated_ms is not None
    assert await store.end_if_unchanged(lost, now.updated_ms)
    done = await store.get(rid)
    assert done is not None and done.status == "failed" and done.updated_ms is not None
    assert done.error is not None and done.error["code"] == "broker-lost"
    assert not await store.end_if_unchanged(lost, done.updated_ms)  # finished: never again


def test_a_workers_cancel_fills_in_the_tokens_the_apis_cancel_lacked() -> None:
    """The API's cancel is the first terminal status (no tokens); the worker's own ``cancelled``
    update, with the tokens made before the cancel took effect, fills them in. Nothing else
    changes the outcome: a late ``completed`` still changes nothing."""
    rec = fold(None, ResultEvent("r", "prefill", "decoding"))
    rec = fold(rec, ResultEvent("r", "api", "cancelled", error=ErrorInfo("cancelled", "client")))
    assert rec is not None and rec.status == "cancelled" and rec.token_ids is None
    worker = ResultEvent(
        "r", "prefill", "cancelled", token_ids=[4, 5], text="ab", info={"prefill.cancelled": "x"}
    )
    rec = fold(rec, worker)
    assert rec is not None and rec.token_ids == [4, 5] and rec.text == "ab"
    assert rec.error is not None
    assert rec.error["message"] == "client"  # the first outcome's error stays
    late = fold(rec, ResultEvent("r", "prefill", "completed", token_ids=[9], text="z"))
    assert late is not None and late.status == "cancelled" and late.token_ids == [4, 5]
    other = fold(None, ResultEvent("q", "api", "cancelled"))
    other = fold(other, ResultEvent("q", "prefill", "expired", token_ids=[1]))
    assert other is not None and other.token_ids is None  # another outcome fills nothing


async def test_a_recorded_update_is_not_folded_again_but_still_pokes_the_sweep(
    store: StatusStore,
) -> None:
    from consumers.results import ResultsCollector

    pokes: list[int] = []
    rc = ResultsCollector(store, on_update=lambda: pokes.append(1))
    assert await store.create("rec1", {"tenant": "t"})
    # Marked recorded (its stage wrote it through): no read, no write, but the request moves.
    await rc.handle(ResultEvent("rec1", "prefill", "prefilling"), recorded=True)
    rec = await store.get("rec1")
    assert rec is not None and rec.status == "queued"
    assert (rc.recorded, rc.applied, rc.duplicates, len(pokes)) == (1, 0, 0, 1)
    await rc.handle(ResultEvent("rec1", "prefill", "prefilling"))
    rec = await store.get("rec1")
    assert rec is not None and rec.status == "prefilling" and rc.applied == 1 and len(pokes) == 2


async def test_an_update_tried_again_after_an_outage_still_goes_before_its_followers(
    store: StatusStore,
) -> None:
    """The router's fan-out update makes an external renderer's record. When it fails (the
    cluster node it needs is down) the loop tries it again later, after the request's next
    updates were dispatched: they wait for it, so the record is made first and folds them all,
    where they would have found no record and been dropped."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from consumers.results import ResultsCollector
    from schemas.status_record import ROUTED_INFO

    class FailsOnce:
        """The real store, whose first write of the fan-out update fails as Redis would."""

        def __init__(self, real: StatusStore) -> None:
            self.real, self.failed = real, False

        async def apply(self, ev: ResultEvent) -> bool:
            if ev.stage == "fanout" and not self.failed:
                self.failed = True
                raise RedisConnectionError("the node is down")
            return await self.real.apply(ev)

    rid = f"r-{uuid.uuid4().hex[:8]}"
    rc = ResultsCollector(FailsOnce(store))  # type: ignore[arg-type]
    made = ResultEvent(rid, "fanout", "encoding", info={ROUTED_INFO: "1"})
    with pytest.raises(RedisConnectionError):
        await rc.handle(made)
    followers = asyncio.gather(
        rc.handle(ResultEvent(rid, "prefill", "prefilling")),
        rc.handle(ResultEvent(rid, "prefill", "completed", token_ids=[1])),
    )
    await asyncio.sleep(0.05)
    assert await store.get(rid) is None and not followers.done()  # they wait for it
    await rc.handle(made)  # the loop's next try of the same event
    await asyncio.wait_for(followers, 5)
    rec = await store.get(rid)
    assert rec is not None and rec.status == "completed", rec
    assert [e["status"] for _, e in await store.events(rid)] == [
        "encoding",
        "prefilling",
        "completed",
    ]
    assert (rc.applied, rc.gone) == (3, 0) and not rc._stalled and not rc._order


async def test_updates_behind_one_that_never_comes_back_go_on_after_the_wait(
    store: StatusStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed update that is dead-lettered is never tried again: the ones behind it wait
    only ``STALL_WAIT_S`` and then fold as they would have."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    import consumers.results as results

    monkeypatch.setattr(results, "STALL_WAIT_S", 0.2)

    rid = f"d-{uuid.uuid4().hex[:8]}"
    assert await store.create(rid, {})
    rc = results.ResultsCollector(
        FailsFirst(store, RedisConnectionError("the node is down"))  # type: ignore[arg-type]
    )
    with pytest.raises(RedisConnectionError):
        await rc.handle(ResultEvent(rid, "prefill", "prefilling"))
    await asyncio.wait_for(rc.handle(ResultEvent(rid, "prefill", "completed", token_ids=[1])), 5)
    rec = await store.get(rid)
    assert rec is not None and rec.status == "completed"
    assert not rc._stalled


async def test_an_update_that_fails_for_good_holds_nothing_back(store: StatusStore) -> None:
    """Only a failure the consume loop tries again marks the request stalled: an update that
    fails for good (a bad payload: dead-lettered at once, never tried again) leaves the
    request's later updates to fold at once, not after ``STALL_WAIT_S``."""
    from consumers.results import ResultsCollector
    from schemas.errors import ValidationError

    rid = f"p-{uuid.uuid4().hex[:8]}"
    assert await store.create(rid, {})
    rc = ResultsCollector(
        FailsFirst(store, ValidationError("status-field", "a field no record takes"))  # type: ignore[arg-type]
    )
    with pytest.raises(ValidationError):
        await rc.handle(ResultEvent(rid, "prefill", "prefilling"))
    assert not rc._stalled
    await asyncio.wait_for(rc.handle(ResultEvent(rid, "prefill", "completed", token_ids=[1])), 1)
    rec = await store.get(rid)
    assert rec is not None and rec.status == "completed"


async def test_updates_folded_together_write_once_and_keep_every_change(
    store: StatusStore,
) -> None:
    """``apply_all``: a stage's updates that queued up fold into the record in one script run,
    yet the status stream gets an entry for each status change among them (in order, each with
    its own stage), the record ends where one-by-one folding ends, the in-flight slot is given
    back by the terminal one, and sending the same batch again changes nothing."""
    rid = f"b-{uuid.uuid4().hex[:8]}"
    assert await store.create(rid, {"tenant": "t"})
    await store.apply(ResultEvent(rid, "fanout", "encoding"))
    assert await store.admit(rid, 1000)
    batch = [
        ResultEvent(rid, "prefill", "prefilling", timings={"wait": 1.0}),
        ResultEvent(rid, "prefill", "decoding"),
        ResultEvent(rid, "prefill", "decoding", info={"x": "1"}),  # no status change
        ResultEvent(rid, "prefill", "completed", token_ids=[4, 5], text="hi"),
    ]
    runs: list[object] = []
    script = store._cas

    async def counted(**kwargs: object) -> object:
        runs.append(kwargs)
        return await script(**kwargs)

    store._cas = counted  # type: ignore[assignment]
    try:
        assert await store.apply_all(batch)
    finally:
        store._cas = script
    assert len(runs) == 1  # one script run for the four updates
    rec = await store.get(rid)
    assert rec is not None and rec.status == "completed" and rec.token_ids == [4, 5]
    assert rec.timings["wait"] == 1.0 and rec.info["x"] == "1" and rec.tenant == "t"
    changes = [(e["status"], e["stage"]) for _, e in await store.events(rid)]
    assert changes == [
        ("queued", "api"),
        ("encoding", "fanout"),
        ("prefilling", "prefill"),
        ("decoding", "prefill"),
        ("completed", "prefill"),
    ]
    assert rid not in [m.decode() for m in await store.client.zrange(store.keys.inflight, 0, -1)]
    assert not await store.apply_all(batch)  # a redelivery folds to nothing
    with pytest.raises(StatusGone):
        await store.apply_all([ResultEvent("never-made", "prefill", "prefilling")] * 2)


class FailsFirst:
    """The real store, whose first ``apply`` raises ``error`` (the rest go through)."""

    def __init__(self, real: StatusStore, error: Exception) -> None:
        self.real, self.error, self.calls = real, error, 0

    async def apply(self, ev: ResultEvent) -> bool:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return await self.real.apply(ev)
