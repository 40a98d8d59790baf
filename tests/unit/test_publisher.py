"""Stage logic through the Publisher seam, without a broker (an in-memory publisher).

The fan-out and the results reporter publish through ``runtime.publisher.Publisher``; here the
records they would send are checked directly: topics, keys, order, and that every record decodes.
The same stages run against the real broker in the integration and end-to-end tests.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from pydantic import SecretStr

from media.sample_images import synthetic_image
from producers.fanout import build_fanout
from producers.render import Renderer
from runtime.model import load_render_info
from runtime.publisher import InMemoryPublisher, Publisher
from runtime.reporting import RequestUpdates, ResultReporter
from runtime.settings import Settings
from runtime.stores.local import LocalStore
from schemas.codec import SCHEMA_HEADER
from schemas.topics import Topics
from schemas.types import EncodeEvent, PrefillEvent, ResultEvent


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer(load_render_info("tiny"), max_image_pixels=4096 * 4096)


def test_in_memory_publisher_is_a_publisher() -> None:
    assert isinstance(InMemoryPublisher(), Publisher)


async def test_fanout_publishes_encode_and_status_before_prefill(renderer: Renderer) -> None:
    settings = Settings(
        topic_prefix=f"unit-{uuid.uuid4().hex[:8]}",
        ec_namespace="ec-unit",
        ec_secret=SecretStr("unit-secret"),
        inline_limit_bytes=1 << 30,
    )
    topics = Topics(settings.topic_prefix)
    store = LocalStore(f"local://pub-{uuid.uuid4().hex[:8]}")
    pub = InMemoryPublisher()
    fanout = build_fanout(settings, store, renderer.info, pub)
    images = [synthetic_image(84, 56, seed=1), synthetic_image(84, 56, seed=1)]
    ev = renderer.render("req-1", prompt="<image> and <image>", images=images)

    stats = await fanout.publish(ev)

    # the status goes out with the encode events and before the prefill event, so a prefill
    # worker's "prefilling" can never land ahead of the request's "encoding"
    assert sorted(r.topic for r in pub.records[:2]) == sorted([topics.encode, topics.results])
    assert pub.records[2].topic == topics.prefill and len(pub.records) == 3
    (enc_rec,) = pub.on(topics.encode)  # the repeated image is encoded once
    enc = enc_rec.event()
    assert isinstance(enc, EncodeEvent) and enc_rec.key == enc.mm_hash
    prefill_rec = pub.on(topics.prefill)[0]
    prefill = prefill_rec.event()
    assert isinstance(prefill, PrefillEvent) and prefill_rec.key == "req-1"
    assert prefill.features.kwargs_data is None  # metadata only
    assert (SCHEMA_HEADER, b"epd.PrefillEvent") in prefill_rec.headers
    (status,) = pub.events(topics.results)
    assert isinstance(status, ResultEvent) and status.status == "encoding"
    assert stats.encode_bytes == len(enc_rec.value)
    assert stats.prefill_bytes == len(prefill_rec.value)

    # Once its embedding is in the store, the same image is a cache hit: no encode event.
    pub.records.clear()
    await store.put(enc.ec_transfer.key, enc.data["image_grid_thw"].float(), 60)
    stats = await fanout.publish(renderer.render("req-2", prompt="<image>", images=images[:1]))
    assert stats.cache_hits == 1 and pub.on(topics.encode) == []
    assert pub.events(topics.results)[0].status == "prefilling"  # type: ignore[union-attr]


async def test_result_reporter_keys_updates_by_request() -> None:
    pub = InMemoryPublisher()
    report = ResultReporter(pub, "t.results", "prefill", "w1")
    await report("req-9", "completed", token_ids=[1, 2], timings={"total": 3.0})
    (rec,) = pub.records
    ev = rec.event()
    assert rec.key == "req-9" and isinstance(ev, ResultEvent)
    assert (ev.stage, ev.status, ev.token_ids, ev.worker) == ("prefill", "completed", [1, 2], "w1")


async def test_result_records_carry_a_stable_id_for_dedupe() -> None:
    pub = InMemoryPublisher()
    report = ResultReporter(pub, "t.results", "encode", "w1")
    await report("req-9", "encoding")
    await report("req-9", "encoding", info={"sent": "again"})  # a redelivery's re-send
    await report("req-9", "rejected")
    ids = [dict(r.headers)[ResultReporter.RESULT_ID_HEADER] for r in pub.records]
    assert ids == [b"req-9:encode:encoding", b"req-9:encode:encoding", b"req-9:encode:rejected"]


async def test_result_reporter_writes_through_to_the_record_and_survives_its_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from schemas.status_record import StatusRecord, fold

    records: dict[str, StatusRecord] = {}
    written: list[ResultEvent] = []

    async def apply(ev: ResultEvent) -> bool:
        written.append(ev)
        new = fold(records.get(ev.request_id), ev)
        if new is not None:
            records[ev.request_id] = new
        return new is not None

    pub = InMemoryPublisher()
    report = ResultReporter(pub, "t.results", "prefill", "w1", record=apply)
    await report("req-7", "decoding")
    await report("req-7", "completed", token_ids=[5], text="x")
    # the record holds the outcome at once, and it is the very update the topic carries, so the
    # results collector folding it later changes nothing (a duplicate)
    assert records["req-7"].status == "completed" and records["req-7"].token_ids == [5]
    assert [r.event() for r in pub.records] == written
    assert all(fold(records["req-7"], ev) is None for ev in written)

    async def broken(ev: ResultEvent) -> bool:
        raise ConnectionError("redis is away")

    pub.records.clear()
    await ResultReporter(pub, "t.results", "prefill", "w1", record=broken)("req-8", "failed")
    assert [r.event().status for r in pub.records] == ["failed"]  # type: ignore[union-attr]
    assert "write-through of req-8 failed failed" in caplog.text


async def test_progress_updates_go_out_in_order_without_holding_the_stage_up() -> None:
    """``soon`` returns before its update is sent; the record and the topic still get every
    update in the order it was made, and the outcome only after all of them."""
    gate = asyncio.Event()
    order: list[str] = []

    async def slow_record(ev: ResultEvent) -> bool:
        if ev.status == "prefilling":
            await gate.wait()  # a slow Redis under the first update
        order.append(ev.status)
        return True

    pub = InMemoryPublisher()
    updates = RequestUpdates(ResultReporter(pub, "t.results", "prefill", record=slow_record), "r")
    updates.soon("prefilling")
    updates.soon("decoding")
    await asyncio.sleep(0.01)
    assert order == []  # the stage went on; nothing overtook the stuck first update
    gate.set()
    await updates.now("completed", token_ids=[1])
    assert order == ["prefilling", "decoding", "completed"]
    assert [r.event().status for r in pub.records] == order  # type: ignore[union-attr]


async def test_updates_queued_behind_a_slow_one_go_out_together_in_order() -> None:
    """While the first update is on its way, the ones made meanwhile queue; they are then
    written through in one batch write (``record_all``) and sent with one wait for the
    broker (``send_all``), in the order they were made, the outcome last."""
    gate = asyncio.Event()
    singles: list[str] = []
    batches: list[list[str]] = []

    async def record(ev: ResultEvent) -> bool:
        if ev.status == "prefilling":
            await gate.wait()
        singles.append(ev.status)
        return True

    async def record_all(events: object) -> bool:
        batches.append([e.status for e in events])  # type: ignore[attr-defined]
        return True

    class Counting(InMemoryPublisher):
        send_alls = 0

        async def send_all(self, topic: str, records: object) -> None:
            Counting.send_alls += 1
            await super().send_all(topic, records)  # type: ignore[arg-type]

    pub = Counting()
    reporter = ResultReporter(pub, "t.results", "prefill", record=record, record_all=record_all)
    updates = RequestUpdates(reporter, "r")
    updates.soon("prefilling")
    await asyncio.sleep(0.01)
    updates.soon("decoding")
    done = asyncio.create_task(updates.now("completed", token_ids=[1]))
    await asyncio.sleep(0.01)
    assert not done.done() and singles == [] and batches == []
    gate.set()
    await asyncio.wait_for(done, 5)
    assert singles == ["prefilling"] and batches == [["decoding", "completed"]]
    assert Counting.send_alls == 1
    assert [r.event().status for r in pub.records] == ["prefilling", "decoding", "completed"]  # type: ignore[union-attr]
    assert all(dict(r.headers).get("epd-recorded") == b"1" for r in pub.records)
    # Nothing queued: the next update goes alone, at once.
    await updates.now("completed")
    assert len(pub.records) == 4


async def test_held_progress_updates_go_out_with_the_outcome_in_one_write_and_one_send() -> None:
    """With a hold (``EPD_STATUS_HOLD_MS``) a request done within it writes its progress and
    its outcome in one record write and one send, in order; the outcome ends the hold at
    once; a progress update alone goes out once the hold has passed."""
    singles: list[str] = []
    batches: list[list[str]] = []

    async def record(ev: ResultEvent) -> bool:
        singles.append(ev.status)
        return True

    async def record_all(events: object) -> bool:
        batches.append([e.status for e in events])  # type: ignore[attr-defined]
        return True

    pub = InMemoryPublisher()
    reporter = ResultReporter(pub, "t.results", "prefill", record=record, record_all=record_all)
    updates = RequestUpdates(reporter, "r", hold_s=30.0)
    updates.soon("prefilling")
    updates.soon("decoding")
    await asyncio.sleep(0.01)
    assert singles == [] and batches == [] and pub.records == []  # held
    await asyncio.wait_for(updates.now("completed", token_ids=[1]), 5)  # not the 30 s hold
    assert singles == [] and batches == [["prefilling", "decoding", "completed"]]
    assert [r.event().status for r in pub.records] == ["prefilling", "decoding", "completed"]  # type: ignore[union-attr]

    # A hold long enough that the check right after it is not overtaken on a loaded host.
    brief = RequestUpdates(reporter, "r2", hold_s=0.5)
    brief.soon("prefilling")
    await asyncio.sleep(0.005)
    assert singles == []
    for _ in range(500):
        if singles:
            break
        await asyncio.sleep(0.01)
    assert singles == ["prefilling"]  # the hold passed with nothing behind it
    await brief.flush()


async def test_a_failed_progress_update_fails_the_next_step_and_abandon_ends_quietly() -> None:
    class Down(InMemoryPublisher):
        async def send(self, *args: object, **kwargs: object) -> int:
            raise ConnectionError("broker away")

    updates = RequestUpdates(ResultReporter(Down(), "t.results", "prefill"), "r")
    updates.soon("prefilling")
    with pytest.raises(ConnectionError):  # raised where the stage waits next, so it retries
        await updates.now("completed")
    stuck = asyncio.Event()

    async def never(ev: ResultEvent) -> bool:
        await stuck.wait()
        return True

    hung = RequestUpdates(ResultReporter(InMemoryPublisher(), "t", "prefill", record=never), "r")
    hung.soon("prefilling")
    await asyncio.sleep(0)
    await asyncio.wait_for(hung.abandon(), 1)  # cancelled, not awaited forever
    await hung.flush()  # nothing left


async def test_fanout_records_its_status_before_the_prefill_event_goes(renderer: Renderer) -> None:
    settings = Settings(
        topic_prefix=f"unit-{uuid.uuid4().hex[:8]}",
        ec_namespace="ec-unit",
        ec_secret=SecretStr("unit-secret"),
        inline_limit_bytes=1 << 30,
    )
    topics = Topics(settings.topic_prefix)
    pub = InMemoryPublisher()
    sent_when_recorded: list[list[str]] = []

    async def record(ev: ResultEvent, *, fields: object = None) -> bool:
        sent_when_recorded.append([r.topic for r in pub.records])
        return True

    store = LocalStore(f"local://pub-{uuid.uuid4().hex[:8]}")
    fanout = build_fanout(settings, store, renderer.info, pub, record=record)
    ev = renderer.render("req-r", prompt="<image>", images=[synthetic_image(84, 56, seed=3)])
    await fanout.publish(ev)
    # the record holds "encoding" before a prefill worker could have the event...
    assert len(sent_when_recorded) == 1 and topics.prefill not in sent_when_recorded[0]
    # ...and then every record went out: the status, the encode event, the prefill event
    assert sorted(r.topic for r in pub.records) == sorted(
        [topics.encode, topics.results, topics.prefill]
    )


async def test_every_publisher_frames_a_record_alike_trace_context_included() -> None:
    """One framing for every publisher (runtime.publisher.frame): the in-memory one used to
    drop the traceparent header the Kafka one sends."""
    from runtime.publisher import frame
    from runtime.tracing import TRACEPARENT, new_traceparent, stage_span

    parent = new_traceparent()
    pub = InMemoryPublisher()
    event = ResultEvent("r1", "test", "completed")
    with stage_span("test", {TRACEPARENT: parent}, request_id="r1"):
        await pub.send("t.results", "r1", event, headers=[("x-extra", b"1")])
        expected = frame(event, "r1", headers=[("x-extra", b"1")])
    (sent,) = pub.records
    headers = dict(sent.headers)
    assert TRACEPARENT in headers and parent.split("-")[1] in headers[TRACEPARENT].decode()
    assert sent.headers == expected.headers and sent.value == expected.value
