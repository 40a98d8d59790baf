"""Real-world inputs end to end on a real broker and Redis, workers in-process (tiny model):

- a 12 MP phone photo (4032x3024 JPEG) under the public Qwen2-VL processor config: rendered,
  fanned out (its ~290 MB of fp32 pixels claim-checked), encoded, prefilled; once with fp32 and
  once with bf16 transport, printing the bytes each topic and the store carried (bf16 halves
  the pixels);
- one request with 16 images of mixed sizes (some repeated): the encoder batches them, the
  prefill worker waits for all of them while small requests run to completion beside it, and
  the tokens equal ``model.generate``'s.

Events are read back from the topics and handed to the workers' ``handle`` (no consume loop),
so every byte counted went through the broker or the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from PIL import Image
from pydantic import SecretStr
from transformers import Qwen2VLImageProcessorPil

from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from gpu_workers.prefill import PrefillWorker
from media.sample_images import synthetic_image
from producers.fanout import build_fanout
from producers.render import Renderer
from runtime.kafka import KafkaPublisher, make_producer, read_topic
from runtime.model import ModelBundle, load_model
from runtime.settings import Settings
from runtime.stores.redis import RedisStore
from schemas.codec import decode
from schemas.topics import Topics
from schemas.types import EncodeEvent, PrefillEvent, RenderEvent, ResultEvent, SamplingParams
from tests.conftest import redis_url_with_db

pytestmark = pytest.mark.integration

REDIS_DB = 12
HANG_GUARD_S = 300.0
"""Guards against a hang only; the 12 MP encode alone takes ~30 s on two CPU cores."""


def public_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's published preprocessor config (max_pixels 12,845,056; patch 14; merge 2)."""
    return Qwen2VLImageProcessorPil(
        min_pixels=3136, max_pixels=12_845_056, patch_size=14, merge_size=2, temporal_patch_size=2
    )


def phone_photo() -> bytes:
    """A 4032x3024 JPEG (quality 90, ~3.4 MB): smooth regions and noise, like a photo."""
    rng = np.random.default_rng(12)
    small = Image.fromarray(rng.integers(0, 255, (378, 504, 3), dtype=np.uint8))
    buf = io.BytesIO()
    small.resize((4032, 3024), Image.Resampling.BILINEAR).save(buf, "JPEG", quality=90)
    return buf.getvalue()


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
async def producer(settings: Settings) -> AsyncIterator[KafkaPublisher]:
    p = KafkaPublisher(make_producer(settings))
    await p.start()
    try:
        yield p
    finally:
        await p.stop()


@pytest.fixture
def namespace() -> str:
    return f"ec-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def cfg(topic_settings: Settings, namespace: str) -> Settings:
    return topic_settings.model_copy(
        update={
            "redis_url": redis_url_with_db(topic_settings.redis_url, REDIS_DB),
            "store_url": "",
            "ec_namespace": namespace,
            "ec_secret": SecretStr("real-inputs-test-secret"),
            "validation_mode": "strict",
            "embedding_wait_s": HANG_GUARD_S,
            "device": "cpu",
        }
    )


@pytest.fixture
async def store(cfg: Settings, namespace: str) -> AsyncIterator[RedisStore]:
    s = RedisStore(cfg.redis_url)
    try:
        yield s
    finally:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(cfg.redis_url)
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await s.close()


async def records(cfg: Settings, topic: str, request_id: str) -> list[tuple[int, Any]]:
    """(wire bytes, decoded event) of every record of ``request_id`` on ``topic``."""
    out = []
    for r in await read_topic(cfg, topic, timeout_s=HANG_GUARD_S):
        ev = decode(r.value)
        if getattr(ev, "request_id", None) == request_id:
            out.append((len(r.value), ev))
    return out


def final(results: list[tuple[int, Any]]) -> ResultEvent:
    (done,) = [ev for _, ev in results if ev.stage == "prefill" and ev.status == "completed"]
    return done


# ------------------------------------------------------------------ 12 MP photo


@pytest.mark.slow
async def test_a_12_megapixel_photo_end_to_end_in_fp32_and_bf16(
    cfg: Settings, bundle: ModelBundle, store: RedisStore, producer: KafkaPublisher
) -> None:
    # The tiny model with the public processor config (patch/merge/temporal sizes agree).
    public = dataclasses.replace(bundle, image_processor=public_processor())
    info = public.render_info()
    photo = phone_photo()
    report: dict[str, Any] = {"image": "4032x3024 JPEG", "jpeg_bytes": len(photo)}
    topics = Topics(cfg.topic_prefix)
    for dtype in ("fp32", "bf16"):
        run = cfg.model_copy(update={"pixel_dtype": dtype})
        renderer = Renderer.for_settings(info, run)
        ev: RenderEvent = await renderer.render_async(
            f"photo-{dtype}-{uuid.uuid4().hex[:8]}",
            prompt="What is in this photo? <image>",
            images=[photo],
            sampling=SamplingParams(max_tokens=3),
            cache_salt=f"{dtype}-{uuid.uuid4().hex}",  # each run encodes (no cross-run hit)
        )
        pv = ev.features.kwargs_data["image"][0]["pixel_values"]
        assert pv.numel() * 4 > 256 * 1024 * 1024  # above the old fixed limit
        stats = await build_fanout(run, store, info, producer).publish(ev)
        assert stats.claim_bytes == pv.numel() * (4 if dtype == "fp32" else 2)

        (enc_size, enc), *_ = await records(run, topics.encode, ev.request_id)
        ((pf_size, pf),) = await records(run, topics.prefill, ev.request_id)
        assert isinstance(enc, EncodeEvent) and isinstance(pf, PrefillEvent)
        encoder = EncodeWorker(
            WorkerContext(run, public, store, producer, worker_id=f"encode-{dtype}")
        )
        prefill = PrefillWorker(
            WorkerContext(run, public, store, producer, worker_id=f"prefill-{dtype}")
        )
        try:
            waiting = asyncio.create_task(prefill.handle(pf))
            await asyncio.wait_for(encoder.handle(enc), HANG_GUARD_S)
            await asyncio.wait_for(waiting, HANG_GUARD_S)
        finally:
            await encoder.close()
            await prefill.close()
        assert encoder.items_encoded == 1 and encoder.claims_deleted == 1
        results = await records(run, topics.results, ev.request_id)
        done = final(results)
        assert len(done.token_ids) == 3
        encoded = [
            (n, e)
            for n, e in await records(run, topics.encoded, ev.request_id)
            if e.request_id == ev.request_id
        ]
        report[dtype] = {
            "pixel_values_shape": list(pv.shape),
            "placeholder_tokens": pf.features.mm_placeholders["image"][0].length,
            "encode_topic_bytes": enc_size,
            "claim_check_store_bytes": stats.claim_bytes,
            "prefill_topic_bytes": pf_size,
            "encoded_topic_bytes": sum(n for n, _ in encoded),
            "results_topic_bytes": sum(n for n, _ in results),
            "embedding_bytes": int(np.prod(encoded[0][1].shape)) * 4,
        }
    print(json.dumps({"12mp_photo": report}, indent=1))
    assert (
        report["bf16"]["claim_check_store_bytes"] * 2 == report["fp32"]["claim_check_store_bytes"]
    )
    assert report["fp32"]["placeholder_tokens"] == 62208 // 4


# ------------------------------------------------------------------ 16 images


def sixteen_images() -> list[Image.Image]:
    """16 images over 10 distinct ones of mixed sizes; image 0 appears three times."""
    sizes = [(56, 56), (84, 56), (112, 112), (140, 84), (224, 224), (70, 196), (168, 112)]
    distinct = [synthetic_image(*sizes[i % len(sizes)], seed=300 + i) for i in range(10)]
    order = [0, 1, 2, 3, 0, 4, 5, 6, 1, 7, 8, 9, 0, 2, 5, 9]
    return [distinct[i] for i in order]


async def test_sixteen_images_batched_with_parity_and_small_requests_not_held_back(
    cfg: Settings, bundle: ModelBundle, store: RedisStore, producer: KafkaPublisher
) -> None:
    info = bundle.render_info()
    renderer = Renderer.for_settings(info, cfg)
    topics = Topics(cfg.topic_prefix)
    images = sixteen_images()
    big = await renderer.render_async(
        f"sixteen-{uuid.uuid4().hex[:8]}",
        prompt="Sixteen: " + " ".join(f"({i}) <image>" for i in range(16)) + " Compare them.",
        images=images,
        sampling=SamplingParams(max_tokens=8),
        cache_salt=uuid.uuid4().hex,
    )
    small = [
        await renderer.render_async(
            f"small-{i}-{uuid.uuid4().hex[:8]}",
            prompt="One: <image>",
            images=[synthetic_image(56, 84, seed=400 + i)],
            sampling=SamplingParams(max_tokens=4),
            cache_salt=uuid.uuid4().hex,
        )
        for i in range(2)
    ]
    for ev in (big, *small):
        await build_fanout(cfg, store, info, producer).publish(ev)

    def only(evs: list[tuple[int, Any]], kind: type) -> list[Any]:
        return [e for _, e in evs if isinstance(e, kind)]

    big_encodes = only(await records(cfg, topics.encode, big.request_id), EncodeEvent)
    assert len(big_encodes) == 10  # repeats of one image are encoded once
    (big_prefill,) = only(await records(cfg, topics.prefill, big.request_id), PrefillEvent)
    assert len(big_prefill.features.mm_hashes["image"]) == 16

    encoder = EncodeWorker(WorkerContext(cfg, bundle, store, producer, worker_id="encode-16"))
    prefill = PrefillWorker(WorkerContext(cfg, bundle, store, producer, worker_id="prefill-16"))
    try:
        # The 16-image request is taken first and waits for its embeddings (none exist yet).
        big_task = asyncio.create_task(prefill.handle(big_prefill))
        # Small requests arriving after it run to completion on the same worker meanwhile.
        for ev in small:
            (enc,) = only(await records(cfg, topics.encode, ev.request_id), EncodeEvent)
            (pf,) = only(await records(cfg, topics.prefill, ev.request_id), PrefillEvent)
            await asyncio.wait_for(encoder.handle(enc), HANG_GUARD_S)
            await asyncio.wait_for(prefill.handle(pf), HANG_GUARD_S)
        assert prefill.tally.completed == 2 and not big_task.done()

        calls_before = encoder.encoder_calls
        await asyncio.wait_for(
            asyncio.gather(*(encoder.handle(e) for e in big_encodes)), HANG_GUARD_S
        )
        await asyncio.wait_for(big_task, HANG_GUARD_S)
    finally:
        await encoder.close()
        await prefill.close()
    # The encode side batches: ten distinct images in fewer vision-tower calls than images.
    big_calls = encoder.encoder_calls - calls_before
    assert encoder.items_encoded == 12 and big_calls < 10

    done = final(await records(cfg, topics.results, big.request_id))
    token_ids, pixels, grids = monolithic_inputs(big)
    assert grids is not None and len({tuple(g) for g in grids.tolist()}) >= 5  # mixed sizes
    expected = await asyncio.to_thread(generate_monolithic, bundle, token_ids, pixels, grids, 8)
    assert expected and done.token_ids == expected
    for ev in small:
        assert len(final(await records(cfg, topics.results, ev.request_id)).token_ids) == 4
    print(json.dumps({"sixteen_images": {"vision_calls": big_calls, "tokens": done.token_ids}}))
