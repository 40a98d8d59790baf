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
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import torch

from epd.local_pipeline import LocalRun, local_pipeline
from producers.sample_images import synthetic_image
from runtime.kafka import read_topic, send_event
from runtime.settings import Settings
from schemas.codec import get_codec
from schemas.types import DeadLetter, EncodeEvent, RenderEvent, SamplingParams
from tests import services as layer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KINDS = ("results", "encode", "prefill", "router")
WAIT_S = 180.0


@pytest.fixture(scope="module")
async def pipeline(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir: Path = tmp_path_factory.mktemp("fault-logs")
    async with local_pipeline(settings, spawn_workers=True, log_dir=log_dir, kinds=KINDS) as run:
        yield run


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def worker_rss(run: LocalRun) -> dict[str, float]:
    assert run.workers is not None
    out = {}
    for i, (kind, proc, _) in enumerate(run.workers.procs):
        if proc.poll() is None:
            out[f"{kind}-{i}"] = round(_rss_mb(proc.pid), 1)
    return out


async def _render(run: LocalRun, seed: int, salt: str) -> RenderEvent:
    return await run.submitter.renderer.render_async(
        f"fault-{uuid.uuid4().hex[:10]}",
        prompt="Describe <image>.",
        images=[synthetic_image(56 + 14 * (seed % 3), 70, seed=seed)],
        sampling=SamplingParams(max_tokens=3),
        cache_salt=salt,
    )


async def stream(
    run: LocalRun,
    n: int,
    *,
    every_s: float,
    fault_after: int,
    fault: Callable[[], Awaitable[None]],
) -> list[str]:
    """Send ``n`` requests, one every ``every_s`` (alternately through the Submitter's fan-out and
    through the render topic and the router), running ``fault`` after ``fault_after`` of them
    while the rest keep coming. Returns the request ids."""
    salt = uuid.uuid4().hex
    sent: list[str] = []
    fault_task: asyncio.Task[None] | None = None
    for i in range(n):
        if i == fault_after:
            fault_task = asyncio.create_task(fault())
        ev = await _render(run, 500 + i, salt)
        if i % 2:
            await run.submitter.submit_rendered(ev)
        else:
            topic = f"{run.settings.topic_prefix}.render"
            await send_event(run.publisher.producer, topic, ev.request_id, ev)
        sent.append(ev.request_id)
        await asyncio.sleep(every_s)
    if fault_task is not None:
        await fault_task
    return sent


async def outcomes(run: LocalRun, ids: list[str]) -> dict[str, dict]:
    """Every request's terminal record (TimeoutError for one that never ends: a lost request)."""
    recs = await asyncio.gather(
        *(run.submitter.wait(r, timeout_s=WAIT_S) for r in ids), return_exceptions=True
    )
    pairs = zip(ids, recs, strict=True)
    return {r: (rec if isinstance(rec, dict) else {"status": "lost"}) for r, rec in pairs}


def figures(name: str, ids: list[str], got: dict[str, dict], **extra: object) -> dict:
    done = [r for r in ids if got[r]["status"] == "completed"]
    lost = [r for r in ids if got[r]["status"] == "lost"]
    fig = {
        "fault": name,
        "sent": len(ids),
        "completed": len(done),
        "lost": len(lost),
        "other": {r: got[r]["status"] for r in ids if r not in done and r not in lost},
        **extra,
    }
    print(f"\nfault figures: {fig}")
    return fig


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
            await asyncio.sleep(3.0)
        finally:
            await asyncio.to_thread(unpause)

    t0 = time.monotonic()
    run = pipeline

    # Submissions block while Redis is frozen (the status write waits): run them concurrently.
    ids = await stream(run, 6, every_s=0.2, fault_after=2, fault=fault)
    got = await outcomes(run, ids)
    fig = figures("redis frozen 3 s", ids, got, seconds=round(time.monotonic() - t0, 1))
    assert run.workers is not None
    run.workers.check_alive()
    assert fig["completed"] == fig["sent"], fig


async def test_poison_records_land_in_the_dlq_and_valid_traffic_finishes(
    pipeline: LocalRun,
) -> None:
    run = pipeline
    prefix = run.settings.topic_prefix
    producer = run.publisher.producer
    codec = get_codec()
    salt = uuid.uuid4().hex

    # Real encode events to corrupt: rendered and planned by the real fan-out.
    base = await _render(run, 900, salt)
    plan = await run.submitter.fanout.plan(base)
    enc = plan.encode[0]
    framed = codec.encode(enc)
    pixels = enc.data["pixel_values"]
    assert isinstance(pixels, torch.Tensor)
    nan_pixels = pixels.clone()
    nan_pixels[0, 0] = float("nan")
    short_pixels = pixels[:-4].clone()  # fewer patch rows than the grid says

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
        (f"{prefix}.prefill", f"pbytes-{tag}", os.urandom(200), "undecodable"),
        (f"{prefix}.render", f"rbytes-{tag}", os.urandom(100), "undecodable"),
    ]

    async def fault() -> None:
        for topic, key, value, _ in poison:
            await producer.send_and_wait(topic, value=value, key=key.encode())

    ids = await stream(run, 6, every_s=0.1, fault_after=2, fault=fault)
    got = await outcomes(run, ids)

    expected = {key: want for _, key, _, want in poison}
    found: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while set(found) != set(expected) and time.monotonic() < deadline:
        for rec in await read_topic(run.settings, f"{prefix}.dlq"):
            letter = codec.decode(rec.value, DeadLetter)
            key = (letter.key or b"").decode(errors="replace")
            if key in expected:
                found[key] = letter.error.rule or letter.error.code
        await asyncio.sleep(0.5)
    fig = figures("poison records", ids, got, poison=len(poison), in_dlq=len(found))
    assert fig["completed"] == fig["sent"], fig
    assert found == expected
    assert run.workers is not None
    run.workers.check_alive()  # no poison record killed a worker
    assert isinstance(enc, EncodeEvent)
