"""Faults under a steady stream of requests, on the real pipeline (broker, Redis, worker processes).

The broker and Redis come from tests/services.py: under CI they are containers, and the Redis
faults are ``docker pause``/``unpause``; in embedded mode they are SIGSTOP/SIGCONT on the process.
Each test prints its figures (sent, completed, lost, in the DLQ) and bounds its own time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from aiokafka.errors import MessageSizeTooLargeError

from epd.local_pipeline import LocalRun, local_pipeline
from runtime.kafka import KafkaPublisher, make_producer, read_topic
from runtime.settings import Settings
from schemas.codec import get_codec
from schemas.types import DeadLetter, EncodeEvent, TensorRef
from tests import services as layer
from tests.fault.traffic import (
    dead_letters_of,
    figures,
    outcomes,
    render_one,
    stream,
    terminal_results,
    worker_rss,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = ("results", "encode", "prefill", "router")
DOWN_S = 5.0
"""How long the Redis faults last (a restart or a freeze of a few seconds)."""
WAIT_OUTAGE_S = 60.0
MAX_MESSAGE_BYTES = 2 * 1024 * 1024


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("fault-logs")
    # A small message cap, so the poison test's oversize record stays a few MB (Tansu keeps
    # every byte in RAM); valid traffic here is well under it.
    cfg = settings.model_copy(update={"max_message_bytes": MAX_MESSAGE_BYTES})
    async with local_pipeline(cfg, spawn_workers=True, log_dir=log_dir, kinds=KINDS) as run:
        yield run


@pytest.mark.tansu
@pytest.mark.parametrize("kind", ["encode", "prefill", "results", "router"])
async def test_kill_9_a_worker_mid_stream_and_restart_it(pipeline: LocalRun, kind: str) -> None:
    run = pipeline
    assert run.workers is not None
    (index,) = run.workers.indices(kind)
    before = worker_rss(run)

    async def fault() -> None:
        assert run.workers is not None
        await asyncio.sleep(0.3)
        code = run.workers.kill(index)
        assert code == -9
        await asyncio.sleep(0.5)
        await run.workers.restart(index)

    ids = await stream(run, 8, every_s=0.15, fault_after=3, fault=fault)
    got = await outcomes(run, ids)
    fig = figures(f"kill -9 {kind}", ids, got, rss_before=before, rss_after=worker_rss(run))
    run.workers.check_alive()  # no other worker died
    assert fig["completed"] == fig["sent"], fig


async def test_redis_down_5s_and_restarted_empty_mid_stream(
    pipeline: LocalRun, test_services: layer.TestServices
) -> None:
    """Redis refuses connections for ~5 s, then comes back empty, while requests keep coming on
    the render topic (the durable path: the Submitter's own status write needs Redis). Before
    the retry budget, every stage's store/status call failed 3 times in under a second and the
    events went to the DLQ as retries_exhausted. Now nothing valid is dead-lettered and every
    request ends completed, or failed as embedding-lost when its embedding was stored before
    the restart and read after it (the documented outcome)."""
    handle = test_services.redis
    if not handle.controllable:
        pytest.skip(f"Redis is not ours to restart in mode {test_services.mode}")
    assert handle.restart is not None and pipeline.workers is not None
    restart = handle.restart
    run = pipeline
    down: list[float] = []

    async def fault() -> None:
        t = time.monotonic()
        await asyncio.to_thread(restart, DOWN_S)
        down.append(round(time.monotonic() - t, 1))

    t0 = time.monotonic()
    salt = uuid.uuid4().hex
    topic = f"{run.settings.topic_prefix}.render"
    ids: list[str] = []
    fault_task = None
    for i in range(30):
        if i == 5:
            fault_task = asyncio.create_task(fault())
        ev = await render_one(run, 600 + i, salt)
        await KafkaPublisher(run.publisher.producer).send(topic, ev.request_id, ev)
        ids.append(ev.request_id)
        await asyncio.sleep(0.2)
    assert fault_task is not None
    await fault_task
    found = await terminal_results(run, ids, WAIT_OUTAGE_S)
    letters = await dead_letters_of(run, ids)
    ends = {
        r: sorted({(e.status, e.error.code if e.error else None) for e in found.get(r, [])})
        for r in ids
    }
    completed = [r for r in ids if ends[r] == [("completed", None)]]
    emb_lost = [r for r in ids if ends[r] == [("failed", "embedding-lost")]]
    fig = {
        "fault": f"redis down {DOWN_S:g} s, restarted empty",
        "sent": len(ids),
        "completed": len(completed),
        "embedding_lost": len(emb_lost),
        "lost": sum(1 for r in ids if not found.get(r)),
        "duplicated": sum(1 for r in ids if len(ends[r]) > 1),
        "in_dlq": len(letters),
        "dlq_codes": sorted({f"{x.consumer_group}:{x.error.code}" for x in letters}),
        "other": {r: ends[r] for r in ids if r not in completed and r not in emb_lost},
        "down_s": down[0] if down else None,
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(f"\nfault figures: {fig}")
    assert run.workers is not None
    run.workers.check_alive()
    assert fig["in_dlq"] == 0, fig
    assert fig["completed"] + fig["embedding_lost"] == fig["sent"], fig
    assert fig["duplicated"] == 0, fig


async def test_redis_frozen_for_seconds_mid_stream(
    pipeline: LocalRun, test_services: layer.TestServices
) -> None:
    handle = test_services.redis
    if not handle.controllable:
        pytest.skip(f"Redis is not ours to freeze in mode {test_services.mode}")
    assert handle.pause is not None and handle.unpause is not None
    pause, unpause = handle.pause, handle.unpause

    async def fault() -> None:
        await asyncio.to_thread(pause)
        try:
            await asyncio.sleep(DOWN_S)
        finally:
            await asyncio.to_thread(unpause)

    t0 = time.monotonic()
    run = pipeline

    # Submissions block while Redis is frozen (the status write waits): run them concurrently.
    ids = await stream(run, 10, every_s=0.2, fault_after=2, fault=fault)
    got = await outcomes(run, ids)
    letters = await dead_letters_of(run, ids)
    fig = figures(
        f"redis frozen {DOWN_S:g} s",
        ids,
        got,
        in_dlq=len(letters),
        seconds=round(time.monotonic() - t0, 1),
    )
    assert run.workers is not None
    run.workers.check_alive()
    assert fig["completed"] == fig["sent"], fig
    assert fig["in_dlq"] == 0, fig


async def test_poison_records_land_in_the_dlq_and_valid_traffic_finishes(
    pipeline: LocalRun,
) -> None:
    run = pipeline
    prefix = run.settings.topic_prefix
    codec = get_codec()
    salt = uuid.uuid4().hex

    # Real encode events to corrupt: rendered and planned by the real fan-out.
    base = await render_one(run, 900, salt)
    plan = await run.submitter.fanout.plan(base)
    enc = plan.encode[0]
    framed = codec.encode(enc)
    pixels = enc.data["pixel_values"]
    assert isinstance(pixels, torch.Tensor)
    nan_pixels = pixels.clone()
    nan_pixels[0, 0] = float("nan")
    short_pixels = pixels[:-4].clone()  # fewer patch rows than the grid says
    grid = enc.data["image_grid_thw"]
    assert isinstance(grid, torch.Tensor)
    # A claim check declaring ~1.4 GB of pixels (over EPD_MAX_TENSOR_BYTES, 256 MB): refused
    # from the declaration, before the store is read or memory is sized by it.
    huge = TensorRef(
        store=run.settings.embedding_store_url,
        key=f"{run.settings.ec_namespace}:huge-{uuid.uuid4().hex[:8]}",
        dtype="float32",
        shape=[300_000, pixels.shape[1]],
        nbytes=300_000 * pixels.shape[1] * 4,
        digest="0" * 64,
    )
    # A well-formed encode event of ~4.8 MB (1024 patches inline): valid in every other way,
    # but over the pipeline's EPD_MAX_MESSAGE_BYTES. The broker may refuse it (Apache Kafka
    # applies the topic's max.message.bytes); Tansu takes it, and consumers receive it anyway.
    big_grid = torch.tensor([[1, 32, 32]], dtype=grid.dtype)
    big_pixels = torch.rand(1024, pixels.shape[1], dtype=pixels.dtype)
    oversize = codec.encode(
        dataclasses.replace(enc, data={"pixel_values": big_pixels, "image_grid_thw": big_grid})
    )
    assert len(oversize) > run.settings.max_message_bytes

    tag = uuid.uuid4().hex[:8]
    poison: list[tuple[str, str, bytes, str]] = [  # (topic, key, value, expected code or rule)
        (f"{prefix}.encode", f"bytes-{tag}", os.urandom(64), "undecodable"),
        (f"{prefix}.encode", f"trunc-{tag}", framed[: len(framed) // 2], "undecodable"),
        (f"{prefix}.encode", f"fp-{tag}", b"\xc3\x01" + os.urandom(8) + framed[10:], "undecodable"),
        (
            f"{prefix}.encode",
            f"nan-{tag}",
            codec.encode(dataclasses.replace(enc, data={**enc.data, "pixel_values": nan_pixels})),
            "tensor-nonfinite",
        ),
        (
            f"{prefix}.encode",
            f"rows-{tag}",
            codec.encode(dataclasses.replace(enc, data={**enc.data, "pixel_values": short_pixels})),
            "grid-consistency",
        ),
        (
            f"{prefix}.prefill",
            f"unsafe-{tag}",
            codec.encode(dataclasses.replace(plan.prefill, ec_transfer_params={})),
            "ec-transfer-required",
        ),
        (
            f"{prefix}.encode",
            f"huge-{tag}",
            codec.encode(dataclasses.replace(enc, data={**enc.data, "pixel_values": huge})),
            "tensor",
        ),
        (f"{prefix}.encode", f"oversize-{tag}", oversize, "oversize"),
        (f"{prefix}.prefill", f"pbytes-{tag}", os.urandom(200), "undecodable"),
        (f"{prefix}.render", f"rbytes-{tag}", os.urandom(100), "undecodable"),
    ]

    # The pipeline's producers are capped at EPD_MAX_MESSAGE_BYTES: a bigger one for the poison.
    big_producer = make_producer(run.settings, max_request_size=4 * len(oversize))
    await big_producer.start()
    refused: list[str] = []

    async def fault() -> None:
        for topic, key, value, _ in poison:
            try:
                await big_producer.send_and_wait(topic, value=value, key=key.encode())
            except MessageSizeTooLargeError:
                refused.append(key)  # the broker enforces the cap itself: nothing to consume

    try:
        ids = await stream(run, 6, every_s=0.1, fault_after=2, fault=fault)
    finally:
        await big_producer.stop()

    got = await outcomes(run, ids)

    expected = {key: want for _, key, _, want in poison if key not in refused}
    found: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while set(found) != set(expected) and time.monotonic() < deadline:
        for rec in await read_topic(run.settings, f"{prefix}.dlq"):
            letter = codec.decode(rec.value, DeadLetter)
            key = (letter.key or b"").decode(errors="replace")
            if key in expected:
                found[key] = letter.error.rule or letter.error.code
        await asyncio.sleep(0.5)
    fig = figures(
        "poison records",
        ids,
        got,
        poison=len(poison),
        in_dlq=len(found),
        refused_by_broker=len(refused),
        dlq_rules=sorted(set(found.values())),
    )
    assert fig["completed"] == fig["sent"], fig
    assert found == expected
    assert run.workers is not None
    run.workers.check_alive()  # no poison record killed a worker
    assert isinstance(enc, EncodeEvent)
