"""The sweep's verdicts (consumers.sweeper.judge): pure, on status records as Redis holds them
(their JSON objects, read as the typed record)."""

from __future__ import annotations

import contextlib
from typing import Any

from aiokafka.partitioner import DefaultPartitioner

from consumers.sweeper import GRACE_MS, Progress, judge
from schemas.status_record import StatusRecord
from schemas.topics import Topics

T = Topics("p")
NOW = 1_000_000_000
STALE = 60_000


def record(**over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "request_id": "r1",
        "status": "prefilling",
        "stages": {"api:queued": NOW - 90_000, "fanout:prefilling": NOW - 90_000},
        "info": {"encode_events": "0", "cache_hits": "1", "deadline_ms": str(NOW + 500_000)},
        "updated_ms": NOW - 90_000,
        "created_ms": NOW - 90_000,
    }
    rec.update(over)
    return rec


def progress(prefill_idle: set[int] = frozenset(), encode_idle: set[int] = frozenset()) -> Progress:
    return Progress(
        idle={T.prefill: frozenset(prefill_idle), T.encode: frozenset(encode_idle)},
        partitions={T.prefill: 4, T.encode: 4},
    )


def partition_of(key: str) -> int:
    parts = [0, 1, 2, 3]
    return int(DefaultPartitioner()(key.encode(), parts, parts))


def verdict(rec: dict[str, Any], prog: Progress) -> tuple[str, str] | None:
    v = judge(StatusRecord.from_dict(rec), now=NOW, stale_ms=STALE, progress=prog, topics=T)
    return None if v is None else (v.status, v.code)


def test_a_prefill_event_its_partition_no_longer_holds_is_broker_lost() -> None:
    p = partition_of("r1")
    assert verdict(record(), progress(prefill_idle={p})) == ("failed", "broker-lost")


def test_a_queued_prefill_event_is_left_alone() -> None:
    """Its partition still has unconsumed records: it may be waiting in a backlog."""
    others = {0, 1, 2, 3} - {partition_of("r1")}
    assert verdict(record(), progress(prefill_idle=others)) is None


def test_a_request_the_prefill_worker_took_is_not_judged_by_its_topic() -> None:
    rec = record(stages={**record()["stages"], "prefill:prefilling": NOW - 80_000})
    assert verdict(rec, progress(prefill_idle={0, 1, 2, 3})) is None


def test_a_recent_change_means_it_is_alive() -> None:
    assert verdict(record(updated_ms=NOW - 1000), progress(prefill_idle={0, 1, 2, 3})) is None


def test_an_unencoded_item_is_lost_only_once_the_whole_encode_topic_is_consumed() -> None:
    rec = record(
        status="encoding",
        stages={
            "api:queued": NOW - 90_000,
            "fanout:encoding": NOW - 90_000,
            "prefill:prefilling": NOW - 89_000,
        },
        info={
            "encode_events": "2",
            "encoded.aaaaaaaaaaaa": "encoded",
            "deadline_ms": str(NOW + 500_000),
        },
    )
    assert verdict(rec, progress(encode_idle={0, 1, 2})) is None
    assert verdict(rec, progress(encode_idle={0, 1, 2, 3})) == ("failed", "broker-lost")
    done = {**rec["info"], "encoded.bbbbbbbbbbbb": "cache_hit"}
    assert verdict({**rec, "info": done}, progress(encode_idle={0, 1, 2, 3})) is None


def test_past_the_deadline_and_its_grace_it_expires_whatever_the_broker_says() -> None:
    info = {**record()["info"], "deadline_ms": str(NOW - GRACE_MS - 1)}
    assert verdict(record(info=info), progress()) == ("expired", "deadline")
    info = {**record()["info"], "deadline_ms": str(NOW - GRACE_MS + 1000)}
    assert verdict(record(info=info, updated_ms=NOW), progress()) is None  # the stage's to say


def test_finished_or_not_yet_fanned_out_records_are_not_the_sweeps() -> None:
    assert verdict(record(status="completed"), progress(prefill_idle={0, 1, 2, 3})) is None
    queued = record(status="queued", stages={"api:queued": NOW - 90_000})
    assert verdict(queued, progress(prefill_idle={0, 1, 2, 3})) is None


def test_an_unreadable_deadline_is_no_deadline() -> None:
    info = {**record()["info"], "deadline_ms": "soon"}
    assert verdict(record(info=info, updated_ms=NOW), progress()) is None


def test_a_topic_the_broker_no_longer_has_held_nothing_that_can_still_come() -> None:
    gone = Progress(idle={}, partitions={}, missing=frozenset({T.prefill, T.encode}))
    assert verdict(record(), gone) == ("failed", "broker-lost")


def handed_off(**over: Any) -> dict[str, Any]:
    """A record the prefill worker handed to the decode stage (and nobody decoded since)."""
    base = record()
    fields: dict[str, Any] = {
        "stages": {**base["stages"], "prefill:prefilling": NOW - 80_000},
        "info": {**base["info"], "prefill.handoff": "decode"},
        "updated_ms": NOW - 80_000,
    }
    return record(**{**fields, **over})


def decode_progress(idle: set[int]) -> Progress:
    return Progress(
        idle={T.prefill: frozenset({0, 1, 2, 3}), T.decode: frozenset(idle)},
        partitions={T.prefill: 4, T.decode: 4},
    )


def test_a_decode_event_its_partition_no_longer_holds_is_broker_lost() -> None:
    p = partition_of("r1")
    assert verdict(handed_off(), decode_progress({p})) == ("failed", "broker-lost")
    v = judge(
        StatusRecord.from_dict(handed_off()),
        now=NOW,
        stale_ms=STALE,
        progress=decode_progress({p}),
        topics=T,
    )
    assert v is not None and "decode event" in v.message


def test_a_handed_off_request_waits_while_its_decode_partition_has_a_backlog() -> None:
    others = {0, 1, 2, 3} - {partition_of("r1")}
    assert verdict(handed_off(), decode_progress(others)) is None
    # No decode group has committed anything (no decode worker yet): not idle, left alone.
    assert verdict(handed_off(), Progress(idle={}, partitions={T.decode: 4})) is None


def test_a_request_a_decode_worker_took_is_not_judged_by_the_decode_topic() -> None:
    base = handed_off()
    rec = handed_off(stages={**base["stages"], "decode:decoding": NOW - 70_000})
    assert verdict(rec, decode_progress({0, 1, 2, 3})) is None


def test_without_a_handoff_the_decode_topic_decides_nothing() -> None:
    base = record()
    took = record(stages={**base["stages"], "prefill:prefilling": NOW - 80_000})
    assert verdict(took, decode_progress({0, 1, 2, 3})) is None


class _Inflight:
    def __init__(self) -> None:
        self.records: list[StatusRecord] = []

    async def unfinished(self, limit: int, *, orphaned_before_ms: int | None = None) -> list:
        return list(self.records)


class _Status:
    def __init__(self) -> None:
        self.inflight = _Inflight()
        self.applied: list[object] = []

    async def apply(self, ev: object) -> bool:
        self.applied.append(ev)
        return False  # a stage ended it first: nothing sent


async def test_the_sweep_backs_off_while_nothing_is_unfinished_and_a_poke_brings_it_back() -> None:
    import asyncio

    from consumers.sweeper import Sweeper
    from runtime.settings import Settings

    settings = Settings(sweep_interval_s=0.05, sweep_idle_interval_s=5.0, topic_prefix="p")
    status = _Status()

    async def progress() -> Progress:
        return Progress({}, {})

    async def send(ev: object) -> None:
        return None

    sweeper = Sweeper(settings, status, send, progress)  # type: ignore[arg-type]
    task = asyncio.create_task(sweeper.run())
    try:
        await asyncio.sleep(1.2)  # 0.05, 0.1, 0.2, 0.4, then 0.8: four or five passes, not 24
        backed_off = sweeper.passes
        assert 3 <= backed_off <= 5, backed_off
        status.inflight.records = [StatusRecord.from_dict(record())]  # a request came
        sweeper.poke()
        await asyncio.sleep(0.3)  # its pass comes at once, then one every 0.05 s
        assert sweeper.passes >= backed_off + 3, (backed_off, sweeper.passes)
        assert sweeper.unfinished == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
