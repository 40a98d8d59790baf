"""Every event type through a real broker (Tansu locally, any Kafka in CI) with the Avro codec."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import pytest
import torch
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from runtime.kafka import KafkaPublisher, make_consumer, make_producer
from runtime.settings import Settings
from schemas.codec import SCHEMA_HEADER, get_codec
from schemas.topics import Topics
from schemas.types import (
    DeadLetter,
    ECTransfer,
    EncodedEvent,
    EncodeEvent,
    ErrorInfo,
    Event,
    Features,
    PlaceholderRange,
    PrefillEvent,
    RenderEvent,
    ResultEvent,
    SamplingParams,
    TensorRef,
)

pytestmark = pytest.mark.integration

# Guards against a hang only (a broken broker must fail the test, not stall the run); nothing
# asserts on how long anything took.
HANG_GUARD_S = 120.0

H1 = "1" * 64
H2 = "2" * 64


def _ec(mm_hash: str) -> ECTransfer:
    store = "redis://127.0.0.1:6379/15"
    return ECTransfer(mm_hash, store, f"ec:tiny:{mm_hash}", 1 << 41, "ab" * 32)


def _pixels(n_patches: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n_patches, 1176), generator=g).to(torch.bfloat16)


def _events(topics: Topics) -> list[tuple[str, str, Event]]:
    """(topic, key, event) for every event type, keyed as docs/design.md's topic table says."""
    grid = torch.tensor([[1, 4, 6]], dtype=torch.int64)
    err = ErrorInfo("rejected", "item 1 is metadata-only", "ec-transfer-required", "image", 1)
    ref = TensorRef(
        "redis://127.0.0.1:6379/15", "claim:r1:0", "bfloat16", [24, 1176], 24 * 1176 * 2, "d" * 64
    )
    render = RenderEvent(
        "r-render",
        "tiny",
        list(range(40)),
        Features(
            mm_hashes={"image": [H1, H2]},
            mm_placeholders={
                "image": [PlaceholderRange(2, 6), PlaceholderRange(12, 6, [True] * 6)]
            },
            kwargs_data={
                "image": [
                    {"pixel_values": _pixels(24, 1), "image_grid_thw": grid},
                    {"pixel_values": _pixels(24, 2), "image_grid_thw": grid},
                ]
            },
            mm_metadata={"image": [{"image_grid_thw": grid}, {"image_grid_thw": grid}]},
        ),
        SamplingParams(max_tokens=8, stop_token_ids=[3]),
        cache_salt="tenant-a",
        deadline_ms=1 << 41,
        trace={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
    )
    encode_inline = EncodeEvent(
        "r-encode",
        "tiny",
        "image",
        0,
        H1,
        {"pixel_values": _pixels(24, 3), "image_grid_thw": grid},
        _ec(H1),
    )
    encode_ref = EncodeEvent(
        "r-encode", "tiny", "image", 1, H2, {"pixel_values": ref, "image_grid_thw": grid}, _ec(H2)
    )
    prefill = PrefillEvent(
        "r-prefill",
        "tiny",
        list(range(40)),
        Features(
            {"image": [H1, H2]},
            {"image": [PlaceholderRange(2, 6), PlaceholderRange(12, 6)]},
            None,
            {"image": [{"image_grid_thw": grid}, {"image_grid_thw": grid}]},
        ),
        {H1: _ec(H1), H2: _ec(H2)},
    )
    encoded = EncodedEvent(H1, "r-encode", "tiny", "redis://", f"ec:tiny:{H1}", "float32", [6, 64])
    result = ResultEvent("r-result", "prefill", "failed", error=err, timings={"prefill": 1.25})
    dead = DeadLetter(topics.prefill, 2, 17, b"r-bad", b"\x00not avro", "epd-prefill", err, 3)
    return [
        (topics.render, render.request_id, render),
        (topics.encode, encode_inline.mm_hash, encode_inline),
        (topics.encode, encode_ref.mm_hash, encode_ref),
        (topics.prefill, prefill.request_id, prefill),
        (topics.encoded, encoded.mm_hash, encoded),
        (topics.results, result.request_id, result),
        (topics.dlq, "r-bad", dead),
    ]


def assert_same(sent: Any, got: Any, path: str = "event") -> None:
    """Structural equality where tensors compare by dtype, shape and exact values."""
    if isinstance(sent, torch.Tensor):
        assert isinstance(got, torch.Tensor), path
        assert (got.dtype, tuple(got.shape)) == (sent.dtype, tuple(sent.shape)), path
        assert torch.equal(got, sent), path
    elif dataclasses.is_dataclass(sent) and not isinstance(sent, type):
        assert type(got) is type(sent), path
        for f in dataclasses.fields(sent):
            assert_same(getattr(sent, f.name), getattr(got, f.name), f"{path}.{f.name}")
    elif isinstance(sent, dict):
        assert isinstance(got, dict) and got.keys() == sent.keys(), path
        for k in sent:
            assert_same(sent[k], got[k], f"{path}[{k!r}]")
    elif isinstance(sent, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(sent), path
        for i, (a, b) in enumerate(zip(sent, got, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    else:
        assert got == sent, f"{path}: {got!r} != {sent!r}"


async def _take(consumer: AIOKafkaConsumer, n: int) -> list[ConsumerRecord]:
    """The next ``n`` records (any partition)."""
    out: list[ConsumerRecord] = []

    async def pull() -> None:
        while len(out) < n:
            batches = await consumer.getmany(timeout_ms=1000, max_records=n - len(out))
            for records in batches.values():
                out.extend(records)

    await asyncio.wait_for(pull(), HANG_GUARD_S)
    return out


async def test_every_event_type_round_trips(settings: Settings, topics: Topics) -> None:
    sent = _events(topics)
    producer = make_producer(settings)
    await producer.start()
    try:
        for topic, key, event in sent:
            await KafkaPublisher(producer).send(topic, key, event)
    finally:
        await producer.stop()

    consumer = make_consumer(settings, *topics.all(), group_id=None)
    await consumer.start()
    try:
        records = await _take(consumer, len(sent))
    finally:
        await consumer.stop()

    codec = get_codec()
    by_place = {(r.topic, r.key.decode()): r for r in records}
    assert len(by_place) == len(sent)
    for topic, key, event in sent:
        rec = by_place[(topic, key)]
        name = codec.schema_name(event)
        assert dict(rec.headers)[SCHEMA_HEADER] == name.encode()
        assert codec.peek(rec.value) == name
        assert_same(event, codec.decode(rec.value, type(event)), name)


async def test_eight_megabyte_event(settings: Settings, topics: Topics) -> None:
    # 4 Mi bf16 values = 8 MiB of pixel data, far above Kafka's 1 MB default.
    pixels = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    grid = torch.tensor([[1, 64, 64]], dtype=torch.int64)
    data = {"pixel_values": pixels, "image_grid_thw": grid}
    event = EncodeEvent("r-big", "tiny", "image", 0, H1, data, _ec(H1))
    producer = make_producer(settings)
    await producer.start()
    try:
        await KafkaPublisher(producer).send(topics.encode, H1, event)
    finally:
        await producer.stop()

    consumer = make_consumer(settings, topics.encode, group_id=None)
    await consumer.start()
    try:
        (rec,) = await _take(consumer, 1)
    finally:
        await consumer.stop()
    assert len(rec.value) > 8 * 1024 * 1024
    assert_same(event, get_codec().decode(rec.value, EncodeEvent))


# Tansu delays a group's first join by about half the session timeout and, after a member leaves,
# the next join by about two session timeouts; 6 s is the smallest value Apache Kafka accepts.
GROUP_TIMEOUTS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000}


async def test_group_resumes_after_committed_offset(settings: Settings, topics: Topics) -> None:
    group = f"test-group-{uuid.uuid4().hex[:8]}"
    events = [ResultEvent(f"r{i}", "prefill", "completed", token_ids=[i]) for i in range(6)]
    producer = make_producer(settings)
    await producer.start()
    try:
        for ev in events:  # one key: one partition, so offsets follow the send order
            await KafkaPublisher(producer).send(topics.results, "same-key", ev)
    finally:
        await producer.stop()

    first = make_consumer(settings, topics.results, group_id=group, **GROUP_TIMEOUTS)
    await first.start()
    try:
        got = await _take(first, 4)
        ids = [get_codec().decode(r.value, ResultEvent).request_id for r in got]
        assert ids == ["r0", "r1", "r2", "r3"]
        tp = TopicPartition(got[2].topic, got[2].partition)
        # Commit through the third event only: the fourth was read but its work "did not finish".
        await first.commit({tp: got[2].offset + 1})
        assert await first.committed(tp) == got[2].offset + 1
    finally:
        await first.stop()

    second = make_consumer(settings, topics.results, group_id=group, **GROUP_TIMEOUTS)
    await second.start()
    try:
        rest = await _take(second, 3)
    finally:
        await second.stop()
    ids = [get_codec().decode(r.value, ResultEvent).request_id for r in rest]
    assert ids == ["r3", "r4", "r5"]
