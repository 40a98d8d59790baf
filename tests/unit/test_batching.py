"""Continuous batching, to the token: 16 concurrent requests of mixed lengths, images and
videos, greedy and seeded-sampled, through the real encode and prefill workers (one prefill
worker, one batch) over Redis, each equal to its own solo ``model.generate``, for every family
(Qwen3-VL: deepstack and timestamped video items included). Then the batch's bounds: the most
sequences at once, the KV budget (waiting, refusing), leaving at once on a cancel."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from pydantic import SecretStr

from gpu_workers.compute import prefill
from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from gpu_workers.engine import COMPLETED, DecodeEngine, DecodeJob
from gpu_workers.oracle import generate_monolithic, monolithic_inputs, monolithic_video_inputs
from gpu_workers.prefill import PrefillWorker
from media.sample_videos import synthetic_frames
from producers.fanout import build_fanout
from producers.render import RenderEvent
from runtime.publisher import InMemoryPublisher
from runtime.settings import Settings
from runtime.stores.redis import RedisStore
from schemas.errors import ValidationError
from schemas.topics import Topics
from schemas.types import PrefillEvent, ResultEvent, SamplingParams
from tests.unit.test_families import (
    SPECS,
    bundle_of,
    rand_image,
    redis_store,  # noqa: F401  (a fixture)
    renderer_of,
)

N = 16


def mixed_requests(spec: str) -> list[RenderEvent]:
    """16 requests: text only, one or two images of three sizes, a video (alone or beside an
    image), prompts of different lengths, 3 to 20 new tokens, greedy and seeded sampling."""
    r = renderer_of(spec)
    sizes = [(56, 56), (100, 150), (84, 112)]
    out = []
    for i in range(N):
        kind = i % 4
        images, videos = [], []
        if kind == 0:
            prompt = "Just text " * (1 + i % 3)
        elif kind == 1:
            prompt = "Describe <image> " + "please " * (i % 3)
            images = [rand_image(*sizes[i % 3], seed=100 + i)]
        elif kind == 2:
            prompt = "Compare <image> with <image>."
            images = [rand_image(*sizes[i % 3], seed=200 + i), rand_image(56, 84, seed=300 + i)]
        else:
            prompt = "What happens in <video>?" if i % 8 == 3 else "Is <image> in <video>?"
            images = [] if i % 8 == 3 else [rand_image(56, 56, seed=400 + i)]
            videos = [synthetic_frames(4 + i % 3, 64, 64, seed=500 + i)]
        sampled = i % 2 == 1
        sampling = SamplingParams(
            max_tokens=3 + (i * 7) % 18,
            ignore_eos=True,
            temperature=0.8 if sampled else 0.0,
            top_k=30 if sampled else 0,
            top_p=0.95 if sampled else 1.0,
            seed=1000 + i if sampled else None,
        )
        out.append(
            r.render(
                f"b{i}-{uuid.uuid4().hex[:6]}",
                prompt=prompt,
                images=images,
                videos=videos,
                sampling=sampling,
            )
        )
    return out


def solo_generate(spec: str, ev: RenderEvent) -> list[int]:
    ids, pv, grid = monolithic_inputs(ev)
    video = monolithic_video_inputs(ev)
    return generate_monolithic(
        bundle_of(spec), ids, pv, grid, 0, sampling=ev.sampling,
        pixel_values_videos=video.get("pixel_values_videos"),
        video_grid_thw=video.get("video_grid_thw"),
        second_per_grid_ts=video.get("second_per_grid_ts"),
    )  # fmt: skip


def settings_for(namespace: str, **extra: Any) -> Settings:
    return Settings(
        topic_prefix=f"bat-{uuid.uuid4().hex[:8]}",
        ec_namespace=namespace,
        ec_secret=SecretStr("batching-secret"),
        inline_limit_bytes=1 << 30,
        **extra,
    )


async def encode_all(
    spec: str, events: list[RenderEvent], store: RedisStore, settings: Settings
) -> tuple[InMemoryPublisher, list[PrefillEvent]]:
    """Fan-out and the real encode worker for every request: the prefill events, ready."""
    bundle = bundle_of(spec)
    pub = InMemoryPublisher()
    fanout = build_fanout(settings, store, bundle.render_info(), pub)
    for ev in events:
        await fanout.publish(ev)
    topics = Topics(settings.topic_prefix)
    encoder = EncodeWorker(WorkerContext(settings, bundle, store, pub, worker_id="enc-bat"))
    try:
        await asyncio.gather(*(encoder.handle(e) for e in pub.events(topics.encode)))
    finally:
        await encoder.close()
    prefills = [e for e in pub.events(topics.prefill) if isinstance(e, PrefillEvent)]
    order = {ev.request_id: i for i, ev in enumerate(events)}
    return pub, sorted(prefills, key=lambda e: order[e.request_id])


def results_by_request(pub: InMemoryPublisher, settings: Settings) -> dict[str, ResultEvent]:
    done = {}
    for e in pub.events(Topics(settings.topic_prefix).results):
        if isinstance(e, ResultEvent) and e.status in ("completed", "failed", "expired"):
            done[e.request_id] = e
    return done


@pytest.mark.parametrize("spec", SPECS)
async def test_sixteen_concurrent_requests_each_equal_their_solo_generate(
    spec: str,
    redis_store: tuple[RedisStore, str],  # noqa: F811
) -> None:
    store, namespace = redis_store
    events = mixed_requests(spec)
    want = {ev.request_id: solo_generate(spec, ev) for ev in events}
    settings = settings_for(namespace)
    pub, prefills = await encode_all(spec, events, store, settings)
    worker = PrefillWorker(
        WorkerContext(settings, bundle_of(spec), store, pub, worker_id="pre-bat")
    )
    try:
        await asyncio.gather(*(worker.handle(p) for p in prefills))
        engine = worker.engine
    finally:
        await worker.close()
    got = results_by_request(pub, settings)
    for ev in events:
        res = got[ev.request_id]
        assert res.status == "completed", res.error
        assert res.token_ids == want[ev.request_id], ev.request_id
    # They really decoded together: far fewer forwards than tokens, a batch of many.
    tokens = sum(len(t) for t in want.values())
    assert engine.largest_batch >= 8, engine.largest_batch
    assert engine.steps < tokens / 4, (engine.steps, tokens)


async def test_the_batch_holds_at_most_max_batch_sequences(
    redis_store: tuple[RedisStore, str],  # noqa: F811
) -> None:
    store, namespace = redis_store
    events = mixed_requests("tiny")[:8]
    want = {ev.request_id: solo_generate("tiny", ev) for ev in events}
    settings = settings_for(namespace, decode_max_batch=3)
    pub, prefills = await encode_all("tiny", events, store, settings)
    worker = PrefillWorker(
        WorkerContext(settings, bundle_of("tiny"), store, pub, worker_id="pre-bat3")
    )
    seen: list[int] = []
    engine = worker.engine
    forward = engine._forward

    def watched(report: Any) -> None:
        seen.append(engine.active)
        forward(report)

    engine._forward = watched  # type: ignore[method-assign]
    try:
        await asyncio.gather(*(worker.handle(p) for p in prefills))
    finally:
        await worker.close()
    assert max(seen) == 3
    got = results_by_request(pub, settings)
    assert all(got[rid].token_ids == toks for rid, toks in want.items())


def _job(rid: str, prompt: list[int], max_tokens: int, **kw: Any) -> DecodeJob:
    from gpu_workers.engine import new_sequence

    bundle = bundle_of("tiny")
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return DecodeJob(
        rid,
        new_sequence(bundle, sampling, rid),
        lambda: prefill(bundle, prompt, []),
        kv_tokens=len(prompt) + max_tokens,
        **kw,
    )


async def test_the_kv_budget_makes_requests_wait_and_refuses_one_that_never_fits() -> None:
    bundle = bundle_of("tiny")
    per = DecodeEngine(bundle, max_batch=8, kv_budget_bytes=1).kv_per_token
    # Room for two requests of 40 positions, not three.
    engine = DecodeEngine(bundle, max_batch=8, kv_budget_bytes=per * 40 * 2)
    batch: list[int] = []
    forward = engine._forward
    engine._forward = lambda report: (batch.append(engine.active), forward(report))[1]  # type: ignore[method-assign]
    try:
        jobs = [_job(f"k{i}", list(range(10, 30)), 20) for i in range(3)]
        done = await asyncio.gather(*(engine.run(j) for j in jobs))
        assert [d.outcome for d in done] == [COMPLETED] * 3
        assert max(batch) == 2  # the third waited for room
        solo = generate_monolithic(bundle, list(range(10, 30)), None, None, 20, ignore_eos=True)
        assert all(j.seq.tokens == solo for j in jobs)
        with pytest.raises(ValidationError) as err:
            await engine.run(_job("huge", list(range(10, 30)), 200))
        assert err.value.rule == "kv-budget"
    finally:
        await engine.close()


async def test_a_cancelled_sequence_leaves_the_batch_at_once() -> None:
    bundle = bundle_of("tiny")
    engine = DecodeEngine(bundle, max_batch=8, kv_budget_bytes=1 << 30)
    stop = {"flag": False}
    long = _job("long", list(range(5, 15)), 400, should_stop=lambda: stop["flag"])
    short = _job("short", list(range(20, 31)), 12)
    try:
        running = asyncio.create_task(engine.run(long))
        await asyncio.sleep(0.05)
        short_done = await engine.run(short)
        stop["flag"] = True
        long_done = await asyncio.wait_for(running, 10)
    finally:
        await engine.close()
    assert short_done.outcome == COMPLETED and long_done.outcome == "cancelled"
    assert 12 < len(long.seq.tokens) < 400
    solo = generate_monolithic(bundle, list(range(5, 15)), None, None, 400, ignore_eos=True)
    assert long.seq.tokens == solo[: len(long.seq.tokens)]
    assert short.seq.tokens == generate_monolithic(
        bundle, list(range(20, 31)), None, None, 12, ignore_eos=True
    )
    assert engine.active == 0
