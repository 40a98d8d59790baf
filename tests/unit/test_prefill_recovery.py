"""What the prefill worker decides from a request's status record: skip a replay, or call a
missing embedding lost (pure logic; the workers themselves are in tests/integration)."""

from __future__ import annotations

import pytest

from gpu_workers.lifecycle.embeddings import embeddings_lost
from runtime.status import RequestReader, RequestState
from schemas.status_record import StatusRecord

A = "a" * 64
B = "b" * 64


def test_encoded_items_reads_encoded_and_cache_hits_only() -> None:
    info = {
        f"encoded.{A[:12]}": "encoded",
        f"encoded.{B[:12]}": "cache_hit",
        "encoded.cccccccccccc": "something else",
        f"encode_failed.{'d' * 12}": "error",
        "prefill.cancelled": "x",
    }
    rec = StatusRecord("r", info=info)
    assert rec.encoded_items() == {A[:12], B[:12]}
    assert rec.item_encoded(A) and rec.item_encoded(B) and not rec.item_encoded("c" * 64)


def test_terminal_states_are_the_ones_a_replay_skips() -> None:
    for status in ("completed", "failed", "cancelled", "expired", "rejected"):
        assert RequestState(status, frozenset()).terminal
    for pending in (None, "queued", "encoding", "prefilling", "decoding"):
        assert not RequestState(pending, frozenset()).terminal


def test_a_missing_item_the_record_says_was_encoded_is_lost() -> None:
    state = RequestState("prefilling", frozenset({A[:12]}))
    assert embeddings_lost([A, B], state, created_ms=1_000) == [A]
    assert embeddings_lost([B], state, created_ms=1_000) == []  # B may still be encoding


def test_a_record_wiped_by_a_restart_loses_every_missing_item() -> None:
    wiped = RequestState(None, frozenset(), records_since_ms=5_000)
    assert embeddings_lost([A, B], wiped, created_ms=4_000) == [A, B]
    # Remade after the restart from later updates only: still wiped.
    remade = RequestState("prefilling", frozenset(), oldest_ms=6_000, records_since_ms=5_000)
    assert remade.wiped
    assert embeddings_lost([A], remade, created_ms=4_000) == [A]


def test_no_loss_is_inferred_for_a_new_request_or_a_surviving_record() -> None:
    wiped = RequestState(None, frozenset(), records_since_ms=5_000)
    # Created after Redis (re)started: its record may simply not be written yet.
    assert embeddings_lost([A], wiped, created_ms=5_000) == []
    # The record kept updates from before the start (a Redis with persistence): B is still
    # being encoded, not lost.
    kept = RequestState("prefilling", frozenset(), oldest_ms=4_500, records_since_ms=5_000)
    assert not kept.wiped
    assert embeddings_lost([B], kept, created_ms=4_000) == []
    # Not asked when Redis started: nothing is inferred from a missing record.
    assert embeddings_lost([A], RequestState(None, frozenset()), created_ms=1) == []


def test_an_unreadable_record_decides_nothing() -> None:
    assert embeddings_lost([A], None, created_ms=1) == []


async def test_an_item_stored_while_the_record_is_read_is_not_lost() -> None:
    """The race a throughput run hit: EXISTS finds the key missing, then the encode worker
    stores it and the collector marks it encoded, then the record is read ("encoded"). The key
    is there now, so nothing is lost; a key still missing after that read is."""
    import torch

    from gpu_workers.lifecycle.embeddings import EmbeddingWait, Readiness
    from gpu_workers.lifecycle.outcomes import Outcomes, Tally
    from runtime.reporting import RequestUpdates
    from runtime.stores import open_store
    from schemas.families import FAMILIES

    store = open_store("local://test-lost-race")
    reports: list[tuple[str, str]] = []

    async def report(request_id: str, status: str, **_: object) -> None:
        reports.append((request_id, status))

    async def state_after_encode(request_id: str, since: bool = False) -> RequestState:
        await store.put(f"k-{A}", torch.ones(2))  # encoded between the EXISTS and this read
        return RequestState("prefilling", frozenset({A[:12], B[:12]}))

    tally = Tally()
    wait = EmbeddingWait(
        store,
        FAMILIES["qwen2_vl"],
        Outcomes(tally),
        wait_s=1.0,
        recheck_s=1.0,
        request_state=state_after_encode,
    )
    updates = RequestUpdates(report, "r1")  # type: ignore[arg-type]
    ev = _prefill_event([A, B])
    try:
        # A arrived meanwhile: not lost, and (still missing when asked) waited for
        assert await wait.readiness(ev, {A: f"k-{A}"}, updates) is Readiness.COMING
        assert reports == [] and tally.lost == 0
        # there: no wait at all
        assert await wait.readiness(ev, {A: f"k-{A}"}, updates) is Readiness.PRESENT
        # B is still missing after the record said it was encoded: gone
        both = {A: f"k-{A}", B: f"k-{B}"}
        assert await wait.readiness(ev, both, updates) is Readiness.LOST
        assert reports == [("r1", "failed")] and tally.lost == 1
    finally:
        await store.close()


def _prefill_event(hashes: list[str]) -> object:
    from schemas.types import Features, PlaceholderRange, PrefillEvent

    return PrefillEvent(
        request_id="r1",
        model="m",
        token_ids=[1] * 8,
        features=Features(
            mm_hashes={"image": hashes},
            mm_placeholders={"image": [PlaceholderRange(i * 2, 2) for i in range(len(hashes))]},
            kwargs_data=None,
            mm_metadata=None,
        ),
        ec_transfer_params={},
    )


class _Node:
    def __init__(self, name: str) -> None:
        self.name = name


class _SlotMap:
    """The part of redis-py's ``RedisCluster`` the reader notes roles from (its slot map)."""

    def __init__(self, primaries: list[str], replicas: list[str]) -> None:
        self.primaries, self.replicas = primaries, replicas

    def get_primaries(self) -> list[_Node]:
        return [_Node(n) for n in self.primaries]

    def get_replicas(self) -> list[_Node]:
        return [_Node(n) for n in self.replicas]


def test_a_replica_seen_before_a_failover_is_known_promoted_after_it() -> None:
    """The roles are noted on every read, so the first judgement after a failover (the first
    call that asks ``since``) still knows the new master was a replica: records older than
    its promotion may be lost by Redis, not by an operator."""
    reader = RequestReader(None)  # type: ignore[arg-type]
    before = _SlotMap(["m1", "m2"], ["r1", "r2"])
    reader._observe_roles(before, now=1_000)  # type: ignore[arg-type]
    after = _SlotMap(["r1", "m2"], ["r2"])  # m1 killed, r1 voted in
    assert reader._promotion_ms(after, "r1", now=7_000) == 7_000  # type: ignore[arg-type]
    assert reader._promotion_ms(after, "m2", now=8_000) == 0  # type: ignore[arg-type]
    assert reader._promotion_ms(after, "r1", now=9_000) == 7_000  # type: ignore[arg-type]
    # Its old master came back and took over again: r1 is a replica, no promotion stands.
    back = _SlotMap(["m1", "m2"], ["r1", "r2"])
    assert reader._promotion_ms(back, "r1", now=10_000) == 0  # type: ignore[arg-type]


def test_a_master_that_says_it_took_over_is_dated_when_first_seen_a_master() -> None:
    """Redis 7 leaves a replica that has not synced yet out of the slot map, so a worker on a
    fresh cluster may never see the replica that a failover promotes. The new master's own
    INFO says it took over; the promotion is then dated when this process first saw it a
    master, so a record written before it and lost with the old master reads as Redis's loss."""
    reader = RequestReader(None)  # type: ignore[arg-type]
    reader._observe_roles(_SlotMap(["m1", "m2"], []), now=1_000)  # type: ignore[arg-type]
    after = _SlotMap(["r1", "m2"], [])
    assert reader._promotion_ms(after, "r1", now=7_000, took_over=True) == 7_000  # type: ignore[arg-type]
    assert reader._promotion_ms(after, "r1", now=9_000, took_over=True) == 7_000  # type: ignore[arg-type]
    assert reader._promotion_ms(after, "m2", now=9_000) == 0  # type: ignore[arg-type]
    # A worker started after the failover dates it at its own first sight: records made
    # since then that went were not lost to the failover.
    late = RequestReader(None)  # type: ignore[arg-type]
    late._observe_roles(after, now=20_000)  # type: ignore[arg-type]
    assert late._promotion_ms(after, "r1", now=30_000, took_over=True) == 20_000  # type: ignore[arg-type]
    # A node the slot map does not have yet (the client has not refreshed): dated now.
    assert late._promotion_ms(after, "r9", now=31_000, took_over=True) == 31_000  # type: ignore[arg-type]


def test_took_over_reads_the_previous_replication_id() -> None:
    from runtime.status.reader import _took_over

    zeros = "0" * 40
    assert not _took_over({"role": "master", "master_replid2": zeros})
    assert not _took_over({"role": "master", "master_replid2": 0})  # redis-py reads it an int
    assert _took_over({"role": "master", "master_replid2": "9f1c" + "0" * 36})
    assert not _took_over({"role": "slave", "master_replid2": "9f1c" + "0" * 36})
    assert not _took_over({})


async def test_a_record_never_seen_is_not_judged_gone() -> None:
    """A request admitted while its record was not there (an external renderer's record is
    made by the router's write, which may wait on the results topic behind an outage) goes
    on when a write finds no record; one admitted with its record stops when it goes."""
    import asyncio

    from gpu_workers.lifecycle.record_watch import RecordWatch
    from runtime.status import RequestState

    async def no_record(request_id: str, since: bool = False) -> RequestState:
        return RequestState(None, frozenset(), records_since_ms=0)

    watch = RecordWatch(no_record, "prefill@test")
    watch.admitted("unmade", RequestState(None, frozenset()))
    watch.admitted("made", RequestState("prefilling", frozenset(), oldest_ms=1))
    for rid in ("unmade", "made"):
        watch.track(rid, created_ms=10_000)
        watch.on_gone(rid)
    await asyncio.sleep(0.05)
    assert not watch.untrack("unmade")
    assert watch.untrack("made")
    assert not watch._unmade  # nothing kept once a request leaves


async def test_a_completed_request_waits_for_the_marks_of_the_items_it_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The encoder marks an item encoded a round trip after storing it; a request that ran the
    moment the embedding landed waits (bounded) until its record shows the marks of the items
    it waited for, so its outcome never comes before them. A request that waited for nothing
    reads nothing; a terminal or unreadable record, or marks that never come, end the wait."""
    import time

    import gpu_workers.lifecycle.embeddings as embeddings
    from gpu_workers.lifecycle.admission import Admitted
    from gpu_workers.lifecycle.embeddings import EmbeddingWait
    from gpu_workers.lifecycle.outcomes import Outcomes, Tally
    from runtime.stores import open_store
    from schemas.families import FAMILIES
    from schemas.status_record import short_hash

    reads: list[str] = []
    states: list[RequestState | None] = []

    async def state(request_id: str, since: bool = False) -> RequestState | None:
        reads.append(request_id)
        return states.pop(0) if states else RequestState("prefilling", frozenset())

    wait = EmbeddingWait(
        open_store("local://test-marks"),
        FAMILIES["qwen2_vl"],
        Outcomes(Tally()),
        wait_s=1.0,
        recheck_s=1.0,
        request_state=state,
    )
    ev = _prefill_event([A, B])
    admitted = Admitted({A: f"k-{A}", B: f"k-{B}"}, None, 0, 0.0, None)
    await wait.marks_landed(ev, admitted)
    assert reads == []  # it waited for nothing (all there at admission): no read

    admitted.awaited = [A]
    states[:] = [
        RequestState("prefilling", frozenset()),
        RequestState("decoding", frozenset({short_hash(B)})),
        RequestState("decoding", frozenset({short_hash(A)})),
    ]
    await wait.marks_landed(ev, admitted)
    assert len(reads) == 3  # until A's mark was there

    for last in (RequestState("cancelled", frozenset()), None):
        reads.clear()
        states[:] = [last]
        await wait.marks_landed(ev, admitted)
        assert len(reads) == 1

    monkeypatch.setattr(embeddings, "MARKS_WAIT_S", 0.05)
    t0 = time.perf_counter()
    await wait.marks_landed(ev, admitted)  # the mark's write-through failed: bounded
    assert time.perf_counter() - t0 < 1.0
