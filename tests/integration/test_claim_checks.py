"""Claim-checked encoder inputs on a real Redis store: a short TTL of their own, capped by the
deadline, and deleted once the embedding is stored (retries stay safe: a redelivery is a hit)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from media.sample_images import synthetic_image
from producers.fanout import FanOut, claim_ttl_s
from producers.render import Renderer
from runtime.model import ModelBundle, load_model
from runtime.publisher import InMemoryPublisher
from runtime.settings import Settings
from runtime.stores.redis import RedisStore
from schemas.codec import decode, encode
from schemas.topics import Topics
from schemas.types import EncodedEvent, EncodeEvent, TensorRef, now_ms

pytestmark = pytest.mark.integration

CLAIM_TTL_S = 30


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


@pytest.fixture
def cfg(settings: Settings) -> Settings:
    """This test's namespace; 112x112 images (~150 KB of pixels) claim-checked above 64 KiB."""
    return settings.model_copy(
        update={
            "store_url": "",
            "ec_namespace": f"ec-claim-{uuid.uuid4().hex[:12]}",
            "inline_limit_bytes": 64 * 1024,
            "claim_ttl_s": CLAIM_TTL_S,
            "embedding_ttl_s": 600,
        }
    )


@pytest.fixture
async def store(cfg: Settings) -> AsyncIterator[RedisStore]:
    s = RedisStore(cfg.redis_url)
    client = aioredis.Redis.from_url(cfg.redis_url)
    try:
        yield s
    finally:
        keys = [k async for k in client.scan_iter(match=f"{cfg.ec_namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await s.close()


async def _encode_event(
    cfg: Settings, bundle: ModelBundle, store: RedisStore, deadline_ms: int | None = None
) -> EncodeEvent:
    ev = Renderer(bundle, max_image_pixels=4096 * 4096).render(
        f"req-{uuid.uuid4().hex[:8]}",
        prompt="describe <image>",
        images=[synthetic_image(112, 112, seed=int(uuid.uuid4().int % 1000))],
        deadline_ms=deadline_ms,
    )
    plan = await FanOut(cfg, store, bundle.render_info()).plan(ev)
    [enc] = plan.encode
    return decode(encode(enc))  # as the encode worker receives it


async def _pttl_ms(cfg: Settings, key: str) -> int:
    client = aioredis.Redis.from_url(cfg.redis_url)
    try:
        return int(await client.pttl(key))
    finally:
        await client.aclose()


async def test_claim_is_deleted_once_the_embedding_is_stored(
    cfg: Settings, bundle: ModelBundle, store: RedisStore
) -> None:
    enc = await _encode_event(cfg, bundle, store)
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    # Its own short TTL, not the embedding's ten minutes.
    assert 0 < await _pttl_ms(cfg, ref.key) <= CLAIM_TTL_S * 1000

    pub = InMemoryPublisher()
    worker = EncodeWorker(WorkerContext(cfg, bundle, store, pub))
    try:
        await worker.handle(enc)
        assert worker.items_encoded == 1 and worker.claims_deleted == 1
        assert not await store.exists(ref.key)  # the megabytes are gone...
        assert await store.exists(enc.ec_transfer.key)  # ...the embedding is there

        # A redelivered event (the offset was not committed before a crash) needs no claim.
        await worker.handle(decode(encode(enc)))
        assert worker.items_encoded == 1 and worker.cache_hits == 1
        encoded = pub.events(Topics(cfg.topic_prefix).encoded)
        assert [e.cache_hit for e in encoded if isinstance(e, EncodedEvent)] == [False, True]
    finally:
        await worker.close()


async def test_claim_ttl_is_capped_by_the_deadline(
    cfg: Settings, bundle: ModelBundle, store: RedisStore
) -> None:
    enc = await _encode_event(cfg, bundle, store, deadline_ms=now_ms() + 5_000)
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    assert 0 < await _pttl_ms(cfg, ref.key) <= 5_000


def test_claim_ttl_arithmetic(settings: Settings) -> None:
    s = settings.model_copy(update={"claim_ttl_s": 120})
    assert claim_ttl_s(s, None) == 120
    assert claim_ttl_s(s, 1_000_000 + 30_000, now=1_000_000) == 30
    assert claim_ttl_s(s, 1_000_000 + 900_000, now=1_000_000) == 120
    assert claim_ttl_s(s, 1_000_000 - 5, now=1_000_000) == 1  # past due: still a valid TTL
