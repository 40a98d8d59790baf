"""Encode and prefill workers in-process, on the tiny model, a real broker and a real store.

Each test builds its workers with a real producer and store and calls ``handle(event)``
directly (no consume loop), then reads back what the workers produced from its own topics.
Redis: DB 12, one embedding namespace per test, its keys deleted afterwards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import blake3
import pytest
import torch
from pydantic import SecretStr

from gpu_workers.compute import encode_images
from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from gpu_workers.prefill import PrefillWorker
from media.sample_images import synthetic_image
from producers.fanout import FanOut, FanoutPlan
from producers.render import Renderer
from runtime.kafka import KafkaPublisher, make_producer, read_topic
from runtime.model import ModelBundle, load_model
from runtime.settings import Settings
from runtime.stores.base import EmbeddingStore
from runtime.stores.errors import StoreUnavailable
from runtime.stores.local import LocalStore
from runtime.stores.redis import RedisStore
from schemas.codec import decode, encode
from schemas.errors import ValidationError
from schemas.signing import make_ec_transfer
from schemas.topics import Topics
from schemas.types import (
    EncodedEvent,
    RenderEvent,
    ResultEvent,
    SamplingParams,
    TensorRef,
    now_ms,
)
from tests.conftest import redis_url_with_db

pytestmark = pytest.mark.integration

REDIS_DB = 12
SECRET = "workers-test-secret"
MAX_TOKENS = 8
# Guards against a hang only (a lost wake-up must fail the test, not stall the run).
HANG_GUARD_S = 120.0
# 84x56 -> grid (1, 4, 6), 112x112 -> grid (1, 8, 8): two images of different sizes.
SIZES = ((84, 56), (112, 112))


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
def renderer(bundle: ModelBundle) -> Renderer:
    return Renderer(bundle, max_image_pixels=4096 * 4096)


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
    """Fresh topics, DB 12, this test's namespace and secret, claim checks for every image."""
    return topic_settings.model_copy(
        update={
            "redis_url": redis_url_with_db(topic_settings.redis_url, REDIS_DB),
            "store_url": "",
            "ec_namespace": namespace,
            "ec_secret": SecretStr(SECRET),
            "inline_limit_bytes": 64 * 1024,
            "validation_mode": "strict",
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


@pytest.fixture
async def encoder(
    cfg: Settings, bundle: ModelBundle, store: RedisStore, producer: KafkaPublisher
) -> AsyncIterator[EncodeWorker]:
    w = EncodeWorker(WorkerContext(cfg, bundle, store, producer, worker_id="encode-test"))
    try:
        yield w
    finally:
        await w.close()


def render(
    renderer: Renderer,
    seeds: tuple[int, ...],
    *,
    deadline_ms: int | None = None,
) -> RenderEvent:
    images = [synthetic_image(*SIZES[i % len(SIZES)], seed=s) for i, s in enumerate(seeds)]
    prompt = "describe " + " then ".join("<image>" for _ in seeds) + " please"
    return renderer.render(
        f"req-{uuid.uuid4().hex[:10]}",
        prompt=prompt,
        images=images,
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        deadline_ms=deadline_ms,
    )


async def plan(
    cfg: Settings, store: EmbeddingStore, bundle: ModelBundle, ev: RenderEvent
) -> FanoutPlan:
    return await FanOut(cfg, store, bundle.render_info()).plan(ev)


def wire(event: Any) -> Any:
    """The event as a consumer sees it: through the Avro codec and back."""
    return decode(encode(event))


async def produced(cfg: Settings, topic: str) -> list[Any]:
    return [decode(r.value) for r in await read_topic(cfg, topic, timeout_s=HANG_GUARD_S)]


def item_data(ev: RenderEvent, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    item = (ev.features.kwargs_data or {})["image"][index]
    assert item is not None
    pv, grid = item["pixel_values"], item["image_grid_thw"]
    assert isinstance(pv, torch.Tensor) and isinstance(grid, torch.Tensor)
    return pv, grid


# ------------------------------------------------------------------ encode


async def test_single_flight_then_store_hit(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
) -> None:
    # Three requests with the same image: planned before anything is encoded, so each gets an
    # encode event for the same mm_hash (claim-checked: 84x56 is above the 64 KiB limit).
    renders = [render(renderer, (11,)) for _ in range(3)]
    plans = [await plan(cfg, store, bundle, ev) for ev in renders]
    events = [wire(p.encode[0]) for p in plans]
    assert len({e.mm_hash for e in events}) == 1
    assert isinstance(events[0].data["pixel_values"], TensorRef)

    await asyncio.wait_for(asyncio.gather(*(encoder.handle(e) for e in events)), HANG_GUARD_S)
    assert encoder.items_encoded == 1
    assert encoder.cache_hits == 2
    assert encoder.encoder_calls == 1

    key = events[0].ec_transfer.key
    stored = await store.get(key)
    expected = encode_images(bundle, [item_data(renders[0], 0)])[0]
    assert stored.dtype == expected.dtype and torch.equal(stored, expected)

    encoded = await produced(cfg, Topics(cfg.topic_prefix).encoded)
    assert all(isinstance(e, EncodedEvent) for e in encoded)
    assert sorted(e.cache_hit for e in encoded) == [False, True, True]
    assert {e.key for e in encoded} == {key}
    assert {e.request_id for e in encoded} == {ev.request_id for ev in renders}
    fresh = next(e for e in encoded if not e.cache_hit)
    assert fresh.shape == list(expected.shape) and fresh.store == store.url

    # Later, another request for the same image: a store hit, the encoder does not run. (Its
    # entry is signed for its own request: signatures bind the request id.)
    first = plans[0].encode[0]
    fanout = FanOut(cfg, store, bundle.render_info())
    ec = fanout.ec_transfer("req-later", first.mm_hash, first.mm_hash, None)
    later = wire(dataclasses.replace(first, request_id="req-later", ec_transfer=ec))
    await encoder.handle(later)
    assert (encoder.items_encoded, encoder.cache_hits, encoder.encoder_calls) == (1, 3, 1)
    # Per-item progress travels on the encoded topic only (the results collector folds it in).
    assert await produced(cfg, Topics(cfg.topic_prefix).results) == []
    encoded = await produced(cfg, Topics(cfg.topic_prefix).encoded)
    assert [(e.request_id, e.cache_hit) for e in encoded][-1] == ("req-later", True)


class _LookupAfterRead(RedisStore):
    """A store whose lookup (``touch``) answers only once an input read (``get_bytes``) has
    begun, or after ``patience_s``: it tells whether the encoder starts both together."""

    patience_s = 10.0

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.read_begun = asyncio.Event()
        self.overlapped: list[bool] = []

    async def get_bytes(self, key: str) -> Any:
        self.read_begun.set()
        return await super().get_bytes(key)

    async def touch(self, key: str, ttl_s: float | None) -> bool:
        try:
            await asyncio.wait_for(self.read_begun.wait(), self.patience_s)
            self.overlapped.append(True)
        except TimeoutError:
            self.overlapped.append(False)
        return await super().touch(key, ttl_s)


async def test_the_encoder_reads_its_inputs_beside_the_store_lookup(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
) -> None:
    # A miss (the usual case: the fan-out looked already) must not wait for the lookup's round
    # trip before it asks for its claim-checked pixels.
    ev = render(renderer, (15,))
    p = await plan(cfg, store, bundle, ev)
    event = wire(p.encode[0])
    assert isinstance(event.data["pixel_values"], TensorRef)
    watched = _LookupAfterRead(cfg.redis_url)
    worker = EncodeWorker(WorkerContext(cfg, bundle, watched, producer, worker_id="encode-overlap"))
    try:
        await asyncio.wait_for(worker.handle(event), HANG_GUARD_S)
    finally:
        await worker.close()
        await watched.close()
    assert watched.overlapped == [True], "the claim was read only after the lookup answered"
    assert (worker.items_encoded, worker.encoder_calls) == (1, 1)
    expected = encode_images(bundle, [item_data(ev, 0)])[0]
    assert torch.equal(await store.get(event.ec_transfer.key), expected)


async def test_a_store_hit_drops_the_inputs_read_beside_it_whatever_they_were(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
) -> None:
    # The inputs are read beside the lookup; on a hit they are not needed, so a claim that is
    # gone by then (deleted once encoded, expired) must not fail the item.
    p = await plan(cfg, store, bundle, render(renderer, (17,)))
    ev = wire(p.encode[0])
    ref = ev.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    await store.delete(ref.key)
    await store.put(ev.ec_transfer.key, torch.ones(4, 64))
    watched = _LookupAfterRead(cfg.redis_url)
    worker = EncodeWorker(
        WorkerContext(cfg, bundle, watched, producer, worker_id="encode-hit-overlap")
    )
    try:
        await asyncio.wait_for(worker.handle(ev), HANG_GUARD_S)
    finally:
        await worker.close()
        await watched.close()
    assert watched.overlapped == [True]  # the (failing) read had begun before the hit was known
    assert (worker.items_encoded, worker.cache_hits, worker.encoder_calls) == (0, 1, 0)


async def test_a_store_hit_extends_the_embeddings_lifetime(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
) -> None:
    # The EncodedEvent of a hit tells prefill the embedding is there: it must then stay for
    # embedding_ttl_s, not for whatever was left of an old TTL (here 1 s).
    p = await plan(cfg, store, bundle, render(renderer, (13,)))
    ev = wire(p.encode[0])
    key = ev.ec_transfer.key
    value = torch.ones(4, 64)  # the worker never reads a hit's value
    await store.put(key, value, ttl_s=1)
    await asyncio.wait_for(encoder.handle(ev), HANG_GUARD_S)
    assert (encoder.items_encoded, encoder.cache_hits, encoder.encoder_calls) == (0, 1, 0)
    await asyncio.sleep(1.2)  # past the original TTL (a functional wait, nothing is timed)
    assert await store.exists(key)
    assert torch.equal(await store.get(key), value)


async def test_concurrent_images_share_a_vision_call(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, producer: KafkaPublisher
) -> None:
    # local:// keeps the interleaving deterministic: its exists() does not yield, so all three
    # handlers queue their items before the batcher's first call (Redis round trips would make
    # the batch composition depend on timing).
    store = LocalStore(f"local://workers-{uuid.uuid4().hex[:12]}")
    worker = EncodeWorker(WorkerContext(cfg, bundle, store, producer))
    try:
        ev = render(renderer, (21, 22, 23))
        p = await plan(cfg, store, bundle, ev)
        assert len({e.mm_hash for e in p.encode}) == 3
        await asyncio.wait_for(
            asyncio.gather(*(worker.handle(wire(e)) for e in p.encode)), HANG_GUARD_S
        )
    finally:
        await worker.close()
    assert worker.items_encoded == 3
    assert worker.encoder_calls < 3
    for e in p.encode:
        alone = encode_images(bundle, [item_data(ev, e.item_index)])[0]
        torch.testing.assert_close(await store.get(e.ec_transfer.key), alone)


async def test_claim_check_with_a_wrong_digest_is_rejected(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore, encoder: EncodeWorker
) -> None:
    p = await plan(cfg, store, bundle, render(renderer, (31,)))
    enc = p.encode[0]
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)

    bad = dataclasses.replace(
        enc, data={**enc.data, "pixel_values": dataclasses.replace(ref, digest="0" * 64)}
    )
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(bad))
    assert (err.value.rule, err.value.field) == ("claim-check", "pixel_values")

    # Same reference, but the stored bytes were overwritten: the digest catches that too.
    raw = bytearray(await store.get_bytes(ref.key))
    raw[0] ^= 0xFF
    await store.put_bytes(ref.key, bytes(raw), ttl_s=60)
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(enc))
    assert err.value.rule == "claim-check"

    assert encoder.items_encoded == 0 and encoder.encoder_calls == 0
    assert not await store.exists(enc.ec_transfer.key)


async def test_expired_claim_check_is_reported_failed_not_rejected(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore
) -> None:
    """A claim check gone from the store (expired while queued, lost with Redis) is ours to
    report (``failed``/``input-lost``), not a rejection of the user's input, and not retried."""
    from runtime.publisher import InMemoryPublisher
    from schemas.types import ResultEvent

    p = await plan(cfg, store, bundle, render(renderer, (36,)))
    enc = p.encode[0]
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    await store.delete(ref.key)  # as if its TTL ran out before the encoder got to it
    pub = InMemoryPublisher()
    encoder = EncodeWorker(WorkerContext(cfg, bundle, store, pub))
    try:
        await encoder.handle(wire(enc))
    finally:
        await encoder.close()
    [failed] = [e for e in pub.events(f"{cfg.topic_prefix}.results") if isinstance(e, ResultEvent)]
    assert failed.status == "failed" and failed.error is not None
    assert (failed.error.code, failed.error.rule, failed.error.field) == (
        "input-lost",
        "claim-check",
        "pixel_values",
    )
    assert encoder.items_encoded == 0


async def test_key_for_another_model_is_rejected(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore, encoder: EncodeWorker
) -> None:
    p = await plan(cfg, store, bundle, render(renderer, (41,)))
    enc = p.encode[0]
    other = f"{cfg.ec_namespace}:{'f' * 64}:{enc.mm_hash}"
    # Correctly signed, in the namespace: only the model fingerprint is wrong.
    ec = make_ec_transfer(
        mm_hash=enc.mm_hash,
        store=store.url,
        key=other,
        expires_ms=enc.ec_transfer.expires_ms,
        secret=SECRET.encode(),
        request_id=enc.request_id,
    )
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(dataclasses.replace(enc, ec_transfer=ec)))
    assert err.value.rule == "ec-key"
    assert (err.value.modality, err.value.item) == ("image", 0)
    assert encoder.items_encoded == 0
    assert not await store.exists(other)


async def test_wrong_patch_width_and_unknown_modality_are_rejected(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore, encoder: EncodeWorker
) -> None:
    p = await plan(cfg, store, bundle, render(renderer, (33,)))
    enc = p.encode[0]
    grid = enc.data["image_grid_thw"]
    assert isinstance(grid, torch.Tensor)
    rows = int(grid.prod())
    wide = dataclasses.replace(enc, data={**enc.data, "pixel_values": torch.zeros(rows, 1177)})
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(wide))
    assert (err.value.rule, err.value.field) == ("encode-inputs", "pixel_values")
    audio = dataclasses.replace(enc, modality="audio")
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(audio))
    assert (err.value.rule, err.value.modality) == ("encode-inputs", "audio")
    assert encoder.items_encoded == 0


async def test_claim_check_in_another_store_is_rejected(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore, encoder: EncodeWorker
) -> None:
    p = await plan(cfg, store, bundle, render(renderer, (51,)))
    enc = p.encode[0]
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    elsewhere = dataclasses.replace(ref, store=redis_url_with_db(cfg.redis_url, REDIS_DB + 1))
    bad = dataclasses.replace(enc, data={**enc.data, "pixel_values": elsewhere})
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(bad))
    assert (err.value.rule, err.value.field) == ("claim-check", "pixel_values")
    assert encoder.items_encoded == 0


async def test_encode_past_deadline_is_reported_expired(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore, encoder: EncodeWorker
) -> None:
    p = await plan(cfg, store, bundle, render(renderer, (61,), deadline_ms=now_ms() - 1_000))
    await encoder.handle(wire(p.encode[0]))
    assert encoder.items_encoded == 0 and encoder.encoder_calls == 0
    results = await produced(cfg, Topics(cfg.topic_prefix).results)
    assert [(r.stage, r.status) for r in results] == [("encode", "expired")]
    assert (results[0].error.modality, results[0].error.item) == ("image", 0)


# ------------------------------------------------------------------ prefill


def prefill_results(results: list[Any], request_id: str) -> list[ResultEvent]:
    return [r for r in results if r.stage == "prefill" and r.request_id == request_id]


async def test_prefill_matches_the_monolithic_model(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
) -> None:
    ev = render(renderer, (71, 72))
    grids = [item_data(ev, i)[1].tolist() for i in range(2)]
    assert grids[0] != grids[1]  # two images of different sizes
    p = await plan(cfg, store, bundle, ev)
    assert len(p.encode) == 2

    prefill = PrefillWorker(WorkerContext(cfg, bundle, store, producer, worker_id="prefill-test"))
    try:
        # Prefill starts first and waits on the store; the encoder's puts wake it.
        waiting = asyncio.create_task(prefill.handle(wire(p.prefill)))
        await asyncio.gather(*(encoder.handle(wire(e)) for e in p.encode))
        await asyncio.wait_for(waiting, HANG_GUARD_S)
    finally:
        await prefill.close()
    assert prefill.tally.completed == 1

    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert [r.status for r in results] == ["prefilling", "decoding", "completed"]
    done = results[-1]
    token_ids, pixels, grid = monolithic_inputs(ev)
    expected = generate_monolithic(bundle, token_ids, pixels, grid, MAX_TOKENS)
    assert expected
    assert done.token_ids == expected
    assert done.text == bundle.tokenizer.decode(expected, skip_special_tokens=True)
    assert done.error is None


async def test_prefill_reports_missing_embeddings(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
) -> None:
    ev = render(renderer, (81, 82))
    p = await plan(cfg, store, bundle, ev)
    await encoder.handle(wire(p.encode[0]))  # item 1 is never encoded
    missing = ev.features.mm_hashes["image"][1]

    prefill = PrefillWorker(WorkerContext(cfg, bundle, store, producer), embedding_wait_s=0.5)
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
    finally:
        await prefill.close()
    assert prefill.tally.completed == 0

    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert [r.status for r in results] == ["prefilling", "failed"]
    err = results[-1].error
    assert err is not None and err.code == "embeddings-missing"
    assert missing[:16] in err.message
    assert ev.features.mm_hashes["image"][0][:16] not in err.message
    assert (err.modality, err.item) == ("image", 1)


async def test_an_entry_signed_for_another_store_is_refused_at_once(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
) -> None:
    """A prefill (or encode) worker whose EPD_STORE_URL differs from the fan-out's: the signed
    entries name the fan-out's store, so the worker says so at once (rule ec-store, item named)
    instead of waiting for embeddings parked elsewhere and failing embeddings-missing."""
    ev = render(renderer, (85,))
    p = await plan(cfg, store, bundle, ev)
    await encoder.handle(wire(p.encode[0]))  # the embedding is in the fan-out's store
    other = RedisStore(redis_url_with_db(cfg.redis_url, REDIS_DB + 1))
    # A wait long enough that a worker waiting instead of refusing trips the guard below.
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, other, producer), embedding_wait_s=HANG_GUARD_S * 2
    )
    enc = EncodeWorker(WorkerContext(cfg, bundle, other, producer))
    try:
        with pytest.raises(ValidationError) as err:
            await asyncio.wait_for(prefill.handle(wire(p.prefill)), 10)
        with pytest.raises(ValidationError) as enc_err:
            await asyncio.wait_for(enc.handle(wire(p.encode[0])), 10)
    finally:
        await prefill.close()
        await enc.close()
        await other.close()
    assert (err.value.rule, err.value.modality, err.value.item) == ("ec-store", "image", 0)
    assert store.url in str(err.value) and other.url in str(err.value)
    assert enc_err.value.rule == "ec-store" and enc.items_encoded == 0
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert results == []  # nothing ran, nothing was reported: the loop dead-letters the event


async def test_prefill_past_deadline_expires_without_running(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
) -> None:
    ev = render(renderer, (91,), deadline_ms=now_ms() - 1_000)
    p = await plan(cfg, store, bundle, ev)
    # A long embedding wait: were the worker to wait instead of expiring, the guard would fire.
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, store, producer), embedding_wait_s=HANG_GUARD_S * 2
    )
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
    finally:
        await prefill.close()
    assert prefill.tally.completed == 0
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert [r.status for r in results] == ["expired"]
    assert results[0].error is not None and results[0].error.code == "expired"


async def test_prefill_refuses_metadata_only_item_without_entry(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
) -> None:
    ev = render(renderer, (101, 102))
    p = await plan(cfg, store, bundle, ev)
    dropped = ev.features.mm_hashes["image"][1]
    params = {h: e for h, e in p.prefill.ec_transfer_params.items() if h != dropped}
    bad = wire(dataclasses.replace(p.prefill, ec_transfer_params=params))
    assert bad.features.kwargs_data is None and bad.features.mm_metadata is not None

    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, store, producer), embedding_wait_s=HANG_GUARD_S * 2
    )
    try:
        with pytest.raises(ValidationError) as err:
            await asyncio.wait_for(prefill.handle(bad), HANG_GUARD_S)
    finally:
        await prefill.close()
    assert (err.value.rule, err.value.modality, err.value.item) == (
        "ec-transfer-required",
        "image",
        1,
    )
    assert prefill.tally.completed == 0
    # Rejected before anything ran: not even a "prefilling" update went out.
    assert await produced(cfg, Topics(cfg.topic_prefix).results) == []


async def test_claim_checked_pixels_are_scanned_for_nan_by_the_encoder(
    cfg: Settings, bundle: ModelBundle, renderer: Renderer, store: RedisStore, encoder: EncodeWorker
) -> None:
    # The fan-out checks structure only; the encode worker must catch NaN in claim-checked
    # pixels once it reads them.
    p = await plan(cfg, store, bundle, render(renderer, (71,)))
    enc = p.encode[0]
    ref = enc.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    pixels = torch.frombuffer(bytearray(await store.get_bytes(ref.key)), dtype=torch.float32)
    pixels[5] = float("nan")
    raw = pixels.numpy().tobytes()
    await store.put_bytes(ref.key, raw, ttl_s=60)
    poisoned = dataclasses.replace(
        enc,
        data={
            **enc.data,
            "pixel_values": dataclasses.replace(ref, digest=blake3.blake3(raw).hexdigest()),
        },
    )
    with pytest.raises(ValidationError) as err:
        await encoder.handle(wire(poisoned))
    assert (err.value.rule, err.value.field) == ("tensor-nonfinite", "pixel_values")
    assert encoder.items_encoded == 0


# ------------------------------------------------------------------ forged renders (defect 7)


async def test_forged_render_gets_no_hit_on_another_tenants_embedding(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
) -> None:
    # The victim's request runs through the real fan-out, encoder and prefill on Redis.
    image = synthetic_image(84, 56, seed=111)
    victim = renderer.render(
        "victim-req",
        prompt="<image> what is it",
        images=[image],
        cache_salt="tenant-victim",
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
    )
    (victim_hash,) = victim.features.mm_hashes["image"]
    vp = await plan(cfg, store, bundle, victim)
    await encoder.handle(wire(vp.encode[0]))
    victim_key = vp.encode[0].ec_transfer.key
    assert await store.exists(victim_key)
    prefill = PrefillWorker(WorkerContext(cfg, bundle, store, producer), embedding_wait_s=0.5)
    try:
        await asyncio.wait_for(prefill.handle(wire(vp.prefill)), HANG_GUARD_S)
        assert prefill.tally.completed == 1
        assert (await plan(cfg, store, bundle, victim)).cached == [victim_hash]  # a real hit

        # 1. The attacker's own image, labelled with the victim's mm_hash: refused, no entry.
        mine = renderer.render(
            "attacker-req",
            prompt="<image> what is it",
            images=[synthetic_image(84, 56, seed=112)],
            cache_salt="tenant-attacker",
        )
        forged = dataclasses.replace(
            mine,
            features=dataclasses.replace(mine.features, mm_hashes={"image": [victim_hash]}),
        )
        with pytest.raises(ValidationError) as err:
            await plan(cfg, store, bundle, wire(forged))
        assert (err.value.rule, err.value.modality, err.value.item) == (
            "mm-hash-mismatch",
            "image",
            0,
        )

        # 2. The victim's very pixels under the attacker's salt: another key, so a miss.
        same = renderer.render(
            "attacker-req-2", prompt="<image> what is it", images=[image], cache_salt="x"
        )
        sp = await plan(cfg, store, bundle, same)
        assert sp.cached == [] and len(sp.encode) == 1
        assert sp.encode[0].ec_transfer.key != victim_key

        # 3. The victim's signed entries replayed into the attacker's own prefill event.
        replay = dataclasses.replace(vp.prefill, request_id="attacker-req-3")
        with pytest.raises(ValidationError) as err:
            await asyncio.wait_for(prefill.handle(wire(replay)), HANG_GUARD_S)
        assert err.value.rule == "ec-signature"
        assert prefill.tally.completed == 1
    finally:
        await prefill.close()
    results = await produced(cfg, Topics(cfg.topic_prefix).results)
    assert not [r for r in results if r.request_id.startswith("attacker") and r.stage == "prefill"]


# ------------------------------------------------------------------ prefill bounds (defect 8)


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"token_ids": "oov"}, "render.token_ids"),
        ({"max_tokens": 10**6}, "max-tokens"),
        ({"temperature": -0.8}, "sampling.temperature"),
        ({"temperature": 0.8, "top_p": 0.0}, "sampling.top_p"),
    ],
)
async def test_prefill_refuses_out_of_bounds_requests_before_running(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
    change: dict[str, Any],
    rule: str,
) -> None:
    p = await plan(cfg, store, bundle, render(renderer, (121,)))
    pre = p.prefill
    if "token_ids" in change:
        vocab = int(bundle.config.text_config.vocab_size)  # type: ignore[union-attr]
        pre = dataclasses.replace(pre, token_ids=[vocab + 5, *pre.token_ids[1:]])
    else:
        pre = dataclasses.replace(pre, sampling=dataclasses.replace(pre.sampling, **change))
    # A long embedding wait: nothing is encoded, so a worker that waited would hit the guard.
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, store, producer), embedding_wait_s=HANG_GUARD_S * 2
    )
    try:
        with pytest.raises(ValidationError) as err:
            await asyncio.wait_for(prefill.handle(wire(pre)), HANG_GUARD_S)
    finally:
        await prefill.close()
    assert err.value.rule == rule
    assert prefill.tally.completed == 0
    assert await produced(cfg, Topics(cfg.topic_prefix).results) == []


async def test_prefill_stops_at_the_deadline_between_decode_steps(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpu_workers import engine

    deadline = now_ms() + 600_000
    ev = render(renderer, (131,), deadline_ms=deadline)
    ev = dataclasses.replace(ev, sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    p = await plan(cfg, store, bundle, ev)
    await asyncio.gather(*(encoder.handle(wire(e)) for e in p.encode))
    # The batch's clock passes the deadline after its check before the prefill and those of
    # the first two decode steps.
    ticks = iter([0, 0, 0])
    monkeypatch.setattr(engine, "now_ms", lambda: next(ticks, deadline + 1))
    prefill = PrefillWorker(WorkerContext(cfg, bundle, store, producer))
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
    finally:
        await prefill.close()
    assert prefill.tally.completed == 0
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    # "decoding" is reported between the prefill and the decode steps; the deadline ends it.
    assert [r.status for r in results] in (
        ["prefilling", "expired"],
        ["prefilling", "decoding", "expired"],
    )
    done = results[-1]
    assert done.error is not None and done.error.code == "expired"
    assert done.token_ids is not None and len(done.token_ids) == 3 < MAX_TOKENS


# ------------------------------------------------------------------ replays and lost embeddings


@pytest.fixture
async def status(cfg: Settings, namespace: str) -> AsyncIterator[Any]:
    """A status store on the test DB under this test's namespace (its keys deleted after)."""
    import redis.asyncio as aioredis

    from runtime.status import StatusStore

    client = aioredis.Redis.from_url(cfg.redis_url)
    try:
        yield StatusStore(client, prefix=namespace, ttl_s=600)
    finally:
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


async def fold_into(status: Any, cfg: Settings, request_id: str) -> None:
    """Fold everything produced for ``request_id`` into its record, as the collector does
    (``start``: the record is made by the first, as the router's fan-out would)."""
    from consumers.results import encoded_update

    topics = Topics(cfg.topic_prefix)
    for ev in await produced(cfg, topics.encoded):
        if ev.request_id == request_id:
            await status.start(encoded_update(ev))
    for ev in await produced(cfg, topics.results):
        if ev.request_id == request_id:
            await status.start(ev)


async def test_a_replayed_prefill_event_is_skipped_once_the_request_is_terminal(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
    status: Any,
) -> None:
    from runtime.status import RequestReader

    ev = render(renderer, (61,))
    p = await plan(cfg, store, bundle, ev)
    await encoder.handle(wire(p.encode[0]))
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, store, producer, worker_id="prefill-replay"),
        request_state=RequestReader(status),
    )
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
        await fold_into(status, cfg, ev.request_id)
        assert (await status.get(ev.request_id)).status == "completed"  # type: ignore[union-attr]
        # The same event again, as a redelivery after a crash before the commit would bring it.
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
        # An unsafe event for the finished request is not skipped quietly: it is refused (DLQ).
        unsafe = dataclasses.replace(p.prefill, ec_transfer_params={})
        with pytest.raises(ValidationError) as refused:
            await asyncio.wait_for(prefill.handle(wire(unsafe)), HANG_GUARD_S)
        assert refused.value.rule == "ec-transfer-required"
    finally:
        await prefill.close()
    assert (prefill.tally.completed, prefill.tally.skipped) == (1, 1)
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert [r.status for r in results] == ["prefilling", "decoding", "completed"]


class _FailingReads(RedisStore):
    """A store whose embedding reads fail as if Redis were unreachable."""

    async def get_many(self, keys: Any) -> Any:
        raise StoreUnavailable("reads refused by the test")


async def test_a_finished_requests_redelivery_is_skipped_even_when_the_store_fails_reads(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
    status: Any,
) -> None:
    # The embeddings are read beside the record, ahead of the checks: a failure of that read
    # must not decide before them (a redelivery of a finished request reads nothing it needs).
    from runtime.status import RequestReader

    ev = render(renderer, (63,))
    p = await plan(cfg, store, bundle, ev)
    await encoder.handle(wire(p.encode[0]))
    reader = RequestReader(status)
    prefill = PrefillWorker(WorkerContext(cfg, bundle, store, producer), request_state=reader)
    failing = _FailingReads(cfg.redis_url)
    replayer = PrefillWorker(WorkerContext(cfg, bundle, failing, producer), request_state=reader)
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
        await fold_into(status, cfg, ev.request_id)
        assert (await status.get(ev.request_id)).status == "completed"  # type: ignore[union-attr]
        await asyncio.wait_for(replayer.handle(wire(p.prefill)), HANG_GUARD_S)
    finally:
        await prefill.close()
        await replayer.close()
        await failing.close()
    assert (replayer.tally.skipped, replayer.tally.completed) == (1, 0)


class _SlowReads(RedisStore):
    """A store whose embedding reads take ``delay_s``."""

    delay_s = 1.5

    async def get_many(self, keys: Any) -> Any:
        await asyncio.sleep(self.delay_s)
        return await super().get_many(keys)


async def test_a_deadline_passing_during_the_prefill_reads_expires_the_request(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
) -> None:
    # The entries' expiry is capped at the deadline: a deadline that passes while the worker
    # reads must end the request "expired", not refuse it as ec-expired.
    ev = render(renderer, (65,), deadline_ms=now_ms() + 1_000)
    p = await plan(cfg, store, bundle, ev)
    await encoder.handle(wire(p.encode[0]))
    slow = _SlowReads(cfg.redis_url)
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, slow, producer), embedding_wait_s=HANG_GUARD_S * 2
    )
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
    finally:
        await prefill.close()
        await slow.close()
    assert prefill.tally.completed == 0
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert results and results[-1].status == "expired"
    assert results[-1].error is not None and results[-1].error.code == "expired"


async def test_an_evicted_embedding_fails_the_request_at_once_as_embedding_lost(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
    status: Any,
) -> None:
    from runtime.status import RequestReader

    ev = render(renderer, (71, 72))
    p = await plan(cfg, store, bundle, ev)
    await asyncio.gather(*(encoder.handle(wire(e)) for e in p.encode))
    await fold_into(status, cfg, ev.request_id)  # the record says both items are encoded
    lost = ev.features.mm_hashes["image"][1]
    await store.delete(p.prefill.ec_transfer_params[lost].key)  # as an eviction would
    # A wait far beyond the guard: only telling the loss apart ends this in time.
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, store, producer),
        embedding_wait_s=HANG_GUARD_S * 2,
        request_state=RequestReader(status),
    )
    t0 = asyncio.get_running_loop().time()
    try:
        await asyncio.wait_for(prefill.handle(wire(p.prefill)), HANG_GUARD_S)
    finally:
        await prefill.close()
    assert asyncio.get_running_loop().time() - t0 < 10
    assert (prefill.tally.completed, prefill.tally.lost) == (0, 1)
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert [r.status for r in results] == ["prefilling", "failed"]
    err = results[-1].error
    assert err is not None and err.code == "embedding-lost"
    assert (err.modality, err.item) == ("image", 1)
    assert lost[:16] in err.message


async def test_an_embedding_evicted_during_the_wait_fails_the_request_within_a_recheck(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    encoder: EncodeWorker,
    producer: KafkaPublisher,
    status: Any,
) -> None:
    """The first judgement says "still coming" (item 1 is not encoded yet); item 0, stored and
    marked, is evicted while the request waits. No notification tells of a deletion: only
    judging again during the wait ends the request before the wait does."""
    from runtime.status import RequestReader

    recheck_s = 0.3
    cfg = cfg.model_copy(update={"embedding_recheck_s": recheck_s})
    ev = render(renderer, (73, 74))
    p = await plan(cfg, store, bundle, ev)
    await encoder.handle(wire(p.encode[0]))  # item 1 is never encoded
    await fold_into(status, cfg, ev.request_id)  # the record says item 0 is encoded
    evicted = ev.features.mm_hashes["image"][0]
    prefill = PrefillWorker(
        WorkerContext(cfg, bundle, store, producer),
        embedding_wait_s=HANG_GUARD_S * 2,
        request_state=RequestReader(status),
    )
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    handled = asyncio.ensure_future(prefill.handle(wire(p.prefill)))
    try:
        await asyncio.sleep(recheck_s * 2)  # the worker is waiting for item 1
        assert not handled.done()
        await store.delete(p.prefill.ec_transfer_params[evicted].key)  # as an eviction would
        evicted_at = loop.time()
        await asyncio.wait_for(handled, HANG_GUARD_S)
    finally:
        handled.cancel()
        await prefill.close()
    assert loop.time() - evicted_at < recheck_s + 5, loop.time() - t0
    assert (prefill.tally.completed, prefill.tally.lost) == (0, 1)
    results = prefill_results(await produced(cfg, Topics(cfg.topic_prefix).results), ev.request_id)
    assert [r.status for r in results] == ["prefilling", "failed"]
    err = results[-1].error
    assert err is not None and err.code == "embedding-lost"
    assert (err.modality, err.item) == ("image", 0)
    assert evicted[:16] in err.message


async def test_encode_metrics_count_hits_misses_and_bytes(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    worker = EncodeWorker(WorkerContext(cfg, bundle, store, producer), registry=registry)
    try:
        # 84x56 and 112x112: 24 and 64 patch rows, both above the 64 KiB inline limit, so both
        # are claim-checked and read from the store.
        p = await plan(cfg, store, bundle, render(renderer, (171, 172)))
        for enc in p.encode:
            await worker.handle(wire(enc))
        await worker.handle(wire(p.encode[1]))  # the same item again: a store hit
    finally:
        await worker.close()
    count = registry.get_sample_value
    assert count("epd_encode_items_total", {"outcome": "miss"}) == 2
    assert count("epd_encode_items_total", {"outcome": "hit"}) == 1
    assert count("epd_encode_bytes_in_total") == (24 + 64) * 1176 * 4  # each read once
    embs = [await store.get(e.ec_transfer.key) for e in p.encode]
    out_bytes = sum(e.numel() * e.element_size() for e in embs)
    assert count("epd_encode_bytes_out_total") == out_bytes


async def test_the_encoder_writes_each_items_mark_through_to_the_record(
    cfg: Settings,
    bundle: ModelBundle,
    renderer: Renderer,
    store: RedisStore,
    producer: KafkaPublisher,
    status: Any,
) -> None:
    """No results collector runs here: the items' encoded marks and encode timings are in the
    record as soon as the encoder is done, so a request's outcome (which prefill writes
    through) cannot reach a client ahead of them."""
    ev = render(renderer, (181, 182))
    p = await plan(cfg, store, bundle, ev)
    worker = EncodeWorker(WorkerContext(cfg, bundle, store, producer, record=status.apply))
    assert await status.create(ev.request_id, {})  # as the intake does
    try:
        await asyncio.gather(*(worker.handle(wire(enc)) for enc in p.encode))
    finally:
        await worker.close()
    rec = await status.get(ev.request_id)
    assert rec is not None
    shorts = [h[:12] for h in ev.features.mm_hashes["image"]]
    assert {rec.info.get(f"encoded.{s}") for s in shorts} == {"encoded"}
    assert all(rec.timings[f"encode.{s}"] > 0 for s in shorts)
    # the encoded topic carries the same marks, for the collector (and any other reader)
    encoded = [e for e in await produced(cfg, Topics(cfg.topic_prefix).encoded)]
    assert sorted(e.mm_hash[:12] for e in encoded if e.request_id == ev.request_id) == sorted(
        shorts
    )
