"""FanOut.plan: claim checks, signed ec_transfer_params, metadata-only prefill events, cache skips.

``plan`` needs only a store, so these run against ``local://`` and a real Redis (DB 12, one
embedding namespace per test, its keys deleted afterwards); nothing is sent to a broker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator

import blake3
import pytest
import torch
from pydantic import SecretStr

from media.sample_images import synthetic_image
from producers.fanout import FanOut, FanoutPlan
from producers.render import Renderer
from runtime.model import RenderInfo, load_render_info
from runtime.settings import Settings
from runtime.stores.base import EmbeddingStore
from runtime.stores.local import LocalStore
from runtime.stores.redis import RedisStore
from schemas.codec import get_codec
from schemas.errors import ValidationError
from schemas.signing import verify_ec
from schemas.tensors import tensor_bytes, tensor_from_bytes
from schemas.types import EncodeEvent, ItemData, PrefillEvent, RenderEvent, TensorRef, now_ms
from schemas.validator import ValidationConfig, validate_encode_event, validate_prefill_event
from tests.conftest import redis_url_with_db

REDIS_DB = 12
SECRET = "fanout-test-secret"
# 84x56 -> grid (1, 4, 6): 24 patches x 1176 fp32 = 112,896 bytes of pixel_values.
# 112x112 -> grid (1, 8, 8): 64 patches = 301,056 bytes.
SIZES = ((84, 56), (112, 112))


@pytest.fixture(scope="module")
def info() -> RenderInfo:
    return load_render_info("tiny")


@pytest.fixture(scope="module")
def renderer(info: RenderInfo) -> Renderer:
    return Renderer(info, max_image_pixels=4096 * 4096)


@pytest.fixture
def namespace() -> str:
    """An embedding namespace owned by one test."""
    return f"ec-test-{uuid.uuid4().hex[:12]}"


@pytest.fixture(params=["local", "redis"])
async def store(request: pytest.FixtureRequest, namespace: str) -> AsyncIterator[EmbeddingStore]:
    """A fresh store of each kind; the Redis one lives in DB 12 and is emptied of our keys."""
    if request.param == "local":
        yield LocalStore(f"local://fanout-{uuid.uuid4().hex[:12]}")
        return
    settings: Settings = request.getfixturevalue("settings")
    s = RedisStore(redis_url_with_db(settings.redis_url, REDIS_DB))
    try:
        yield s
    finally:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url_with_db(settings.redis_url, REDIS_DB))
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await s.close()


@pytest.fixture
def local_store() -> LocalStore:
    return LocalStore(f"local://fanout-{uuid.uuid4().hex[:12]}")


def make_settings(namespace: str, *, secret: str | None = None, **kw: object) -> Settings:
    """Settings for one test; explicit values win over any EPD_* in the environment."""
    return Settings(
        ec_namespace=namespace,
        ec_secret=SecretStr(secret) if secret else None,
        **kw,  # type: ignore[arg-type]
    )


def render(
    renderer: Renderer,
    seeds: tuple[int, ...] = (1, 2),
    *,
    deadline_ms: int | None = None,
    sizes: tuple[tuple[int, int], ...] = SIZES,
) -> RenderEvent:
    """A request with one ``<image>`` per seed (image i has size sizes[i % len(sizes)])."""
    images = [synthetic_image(*sizes[i % len(sizes)], seed=s) for i, s in enumerate(seeds)]
    prompt = "look " + " and ".join("<image>" for _ in seeds) + " now"
    return renderer.render(
        f"req-{uuid.uuid4().hex[:8]}", prompt=prompt, images=images, deadline_ms=deadline_ms
    )


def pixel_bytes(ev: RenderEvent) -> list[int]:
    data = ev.features.kwargs_data or {}
    return [it["pixel_values"].nbytes for it in data["image"] if it is not None]  # type: ignore[union-attr]


async def plan_for(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, settings: Settings, **kw: object
) -> tuple[RenderEvent, FanoutPlan]:
    ev = render(renderer, **kw)  # type: ignore[arg-type]
    return ev, await FanOut(settings, store, info).plan(ev)


# ------------------------------------------------------------------ inline vs claim check


async def test_pixels_inline_under_the_limit(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    ev = render(renderer)
    settings = make_settings(namespace, inline_limit_bytes=max(pixel_bytes(ev)) + 1)
    plan = await FanOut(settings, store, info).plan(ev)

    src = ev.features.kwargs_data["image"]  # type: ignore[index]
    assert [e.item_index for e in plan.encode] == [0, 1]
    for enc in plan.encode:
        item = src[enc.item_index]
        assert item is not None
        assert isinstance(enc.data["pixel_values"], torch.Tensor)
        assert torch.equal(enc.data["pixel_values"], item["pixel_values"])  # type: ignore[arg-type]
        assert torch.equal(enc.data["image_grid_thw"], item["image_grid_thw"])  # type: ignore[arg-type]


async def test_pixels_claim_checked_over_the_limit(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    ev = render(renderer)
    # Between the two items' sizes: the small image stays inline, the large one is claim-checked.
    small, large = pixel_bytes(ev)
    settings = make_settings(namespace, inline_limit_bytes=(small + large) // 2)
    plan = await FanOut(settings, store, info).plan(ev)

    src = ev.features.kwargs_data["image"]  # type: ignore[index]
    inline, claimed = plan.encode
    assert isinstance(inline.data["pixel_values"], torch.Tensor)
    ref = claimed.data["pixel_values"]
    assert isinstance(ref, TensorRef)
    pv = src[1]["pixel_values"]  # type: ignore[index]
    assert isinstance(pv, torch.Tensor)
    assert ref.store == store.url
    assert ref.key.startswith(f"{namespace}:")
    assert (ref.dtype, ref.shape) == ("float32", list(pv.shape))
    assert ref.nbytes == pv.numel() * pv.element_size() == large

    raw = await store.get_bytes(ref.key)
    assert raw == tensor_bytes(pv)
    assert ref.digest == blake3.blake3(raw).hexdigest()
    back = tensor_from_bytes(ref.dtype, ref.shape, raw)
    assert back.dtype == pv.dtype and torch.equal(back, pv)
    # Only the heavy field is claim-checked: the grid stays inline for the validator and prefill.
    assert isinstance(claimed.data["image_grid_thw"], torch.Tensor)
    assert torch.equal(claimed.data["image_grid_thw"], src[1]["image_grid_thw"])  # type: ignore[arg-type,index]
    validate_encode_event(claimed, ValidationConfig.from_settings(settings))


async def test_grid_stays_inline_even_with_a_zero_limit(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    """A limit below the grid's 24 bytes must not claim-check metadata (the grid must be inline)."""
    settings = make_settings(namespace, inline_limit_bytes=0)
    _, plan = await plan_for(renderer, info, local_store, settings)
    config = ValidationConfig.from_settings(settings)
    for enc in plan.encode:
        assert isinstance(enc.data["pixel_values"], TensorRef)
        assert isinstance(enc.data["image_grid_thw"], torch.Tensor)
        validate_encode_event(enc, config)


# ------------------------------------------------------------------ signatures


async def test_entries_are_signed_and_namespaced(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    settings = make_settings(namespace, secret=SECRET)
    ev, plan = await plan_for(renderer, info, store, settings)
    params = plan.prefill.ec_transfer_params
    hashes = [h for _, _, h in ev.features.items()]
    assert sorted(params) == sorted(hashes)
    for h, ec in params.items():
        assert ec.mm_hash == h
        assert ec.key == f"{namespace}:{info.fingerprint}:{h}"
        assert ec.store == store.url
        assert ec.signature and verify_ec(SECRET.encode(), ec, request_id=ev.request_id)
        assert not verify_ec(b"another-secret", ec, request_id=ev.request_id)
        # Bound to this request: not valid for another one, nor as an unbound entry.
        assert not verify_ec(SECRET.encode(), ec, request_id=ev.request_id + "x")
        assert not verify_ec(SECRET.encode(), ec)
    for enc in plan.encode:
        assert enc.ec_transfer == params[enc.mm_hash]


async def test_tampering_breaks_the_signature(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    settings = make_settings(namespace, secret=SECRET)
    _, plan = await plan_for(renderer, info, local_store, settings)
    secret = SECRET.encode()
    h0, h1 = plan.prefill.ec_transfer_params
    ec = plan.prefill.ec_transfer_params[h0]
    forged = [
        dataclasses.replace(ec, key=f"{namespace}:{info.fingerprint}:{h1}"),
        dataclasses.replace(ec, key=f"{namespace}:other-model:{h0}"),
        dataclasses.replace(ec, expires_ms=ec.expires_ms + 3_600_000),
        dataclasses.replace(ec, store="redis://10.0.0.1:6379/0"),
        dataclasses.replace(ec, mm_hash=h1),
    ]
    rid = plan.prefill.request_id
    assert verify_ec(secret, ec, request_id=rid)
    for bad in forged:
        assert not verify_ec(secret, bad, request_id=rid), bad

    # The prefill gate refuses forged entries (naming the item), not just verify_ec: a key
    # re-pointed at another item or another model fails the signature that binds it.
    for bad, rule in ((forged[0], "ec-signature"), (forged[1], "ec-signature")):
        params = dict(plan.prefill.ec_transfer_params)
        params[h0] = bad
        bad_event = dataclasses.replace(plan.prefill, ec_transfer_params=params)
        with pytest.raises(ValidationError) as err:
            validate_prefill_event(bad_event, ValidationConfig.from_settings(settings))
        assert err.value.rule == rule
        assert (err.value.modality, err.value.item) == ("image", 0)


async def test_no_secret_means_empty_signatures(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    _, plan = await plan_for(renderer, info, local_store, make_settings(namespace))
    assert plan.prefill.ec_transfer_params
    assert all(ec.signature == "" for ec in plan.prefill.ec_transfer_params.values())
    assert all(enc.ec_transfer.signature == "" for enc in plan.encode)


# ------------------------------------------------------------------ the prefill event


@pytest.mark.parametrize("secret", [SECRET, None], ids=["signed", "unsigned"])
async def test_prefill_event_is_metadata_only_and_valid(
    renderer: Renderer,
    info: RenderInfo,
    local_store: LocalStore,
    namespace: str,
    secret: str | None,
) -> None:
    settings = make_settings(namespace, secret=secret, inline_limit_bytes=1 << 30)
    ev, plan = await plan_for(renderer, info, local_store, settings)
    pre = plan.prefill
    assert pre.features.kwargs_data is None
    assert pre.features.mm_hashes == ev.features.mm_hashes
    assert pre.features.mm_placeholders == ev.features.mm_placeholders
    assert pre.token_ids == ev.token_ids
    meta = pre.features.mm_metadata
    assert meta is not None and list(meta) == ["image"]
    src = ev.features.kwargs_data["image"]  # type: ignore[index]
    for i, item in enumerate(meta["image"]):
        assert item is not None and set(item) == {"image_grid_thw"}
        assert torch.equal(item["image_grid_thw"], src[i]["image_grid_thw"])  # type: ignore[arg-type,index]

    config = ValidationConfig.from_settings(settings)
    assert config.mode == "strict"
    validate_prefill_event(pre, config)
    codec = get_codec()
    wire = codec.encode(pre)
    validate_prefill_event(codec.decode(wire), config)  # and after the wire round trip

    render_bytes = len(codec.encode(ev))
    assert render_bytes > sum(pixel_bytes(ev))
    assert len(wire) < 2048
    assert len(wire) * 100 < render_bytes

    # The gate is what makes metadata-only safe: without the entry it refuses the item.
    h1 = ev.features.mm_hashes["image"][1]
    params = {h: e for h, e in pre.ec_transfer_params.items() if h != h1}
    with pytest.raises(ValidationError) as err:
        validate_prefill_event(dataclasses.replace(pre, ec_transfer_params=params), config)
    assert (err.value.rule, err.value.modality, err.value.item) == (
        "ec-transfer-required",
        "image",
        1,
    )


# ------------------------------------------------------------------ encoder cache and dedupe


async def test_stored_item_is_not_sent_to_encode(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    settings = make_settings(namespace, secret=SECRET)
    ev = render(renderer)
    h0, h1 = ev.features.mm_hashes["image"]
    fanout = FanOut(settings, store, info)
    await store.put(fanout.store_key(h0), torch.zeros(6, 64), ttl_s=60)

    plan = await fanout.plan(ev)
    assert plan.cached == [h0]
    assert [(e.mm_hash, e.item_index) for e in plan.encode] == [(h1, 1)]
    # Prefill still gets a signed entry for the cached item: it reads it from the store.
    assert sorted(plan.prefill.ec_transfer_params) == sorted([h0, h1])
    validate_prefill_event(plan.prefill, ValidationConfig.from_settings(settings))


async def test_a_hit_extends_the_embeddings_lifetime(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    # An embedding with a second left counts as cached, so prefill is promised it for
    # embedding_ttl_s: the hit must extend it, or it vanishes and nothing re-encodes it.
    settings = make_settings(namespace, secret=SECRET, embedding_ttl_s=600)
    ev = render(renderer, seeds=(3,), sizes=((84, 56),))
    (h0,) = ev.features.mm_hashes["image"]
    fanout = FanOut(settings, store, info)
    key = fanout.store_key(h0)
    await store.put(key, torch.zeros(6, 64), ttl_s=1)

    plan = await fanout.plan(ev)
    assert plan.cached == [h0] and plan.encode == []
    await asyncio.sleep(1.2)  # past the original TTL (a functional wait, nothing is timed)
    assert await store.exists(key)
    assert torch.equal(await store.get(key), torch.zeros(6, 64))


async def test_repeated_image_yields_one_encode_event(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    settings = make_settings(namespace, secret=SECRET)
    ev = render(renderer, seeds=(7, 7, 8), sizes=((84, 56),))
    hashes = ev.features.mm_hashes["image"]
    assert hashes[0] == hashes[1] != hashes[2]

    plan = await FanOut(settings, local_store, info).plan(ev)
    assert [(e.mm_hash, e.item_index) for e in plan.encode] == [(hashes[0], 0), (hashes[2], 2)]
    assert plan.cached == []
    assert sorted(plan.prefill.ec_transfer_params) == sorted({hashes[0], hashes[2]})
    assert plan.prefill.features.mm_hashes["image"] == hashes  # prefill still sees three items
    validate_prefill_event(plan.prefill, ValidationConfig.from_settings(settings))


# ------------------------------------------------------------------ expiry


async def test_expiry_is_ttl_or_deadline_whichever_is_first(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    ttl_s = 600
    settings = make_settings(namespace, secret=SECRET, embedding_ttl_s=ttl_s)
    fanout = FanOut(settings, local_store, info)

    before = now_ms()
    plan = await fanout.plan(render(renderer))
    after = now_ms()
    for ec in plan.prefill.ec_transfer_params.values():
        assert before + ttl_s * 1000 <= ec.expires_ms <= after + ttl_s * 1000

    soon = now_ms() + 5_000  # before the TTL runs out: the deadline wins
    plan = await fanout.plan(render(renderer, deadline_ms=soon))
    assert {ec.expires_ms for ec in plan.prefill.ec_transfer_params.values()} == {soon}
    assert all(e.deadline_ms == soon for e in plan.encode)
    assert plan.prefill.deadline_ms == soon

    late = now_ms() + 10 * ttl_s * 1000  # after the TTL: the TTL wins
    before = now_ms()
    plan = await fanout.plan(render(renderer, deadline_ms=late))
    after = now_ms()
    for ec in plan.prefill.ec_transfer_params.values():
        assert before + ttl_s * 1000 <= ec.expires_ms <= after + ttl_s * 1000 < late
        # The signature covers the expiry it carries.
        assert verify_ec(SECRET.encode(), ec, request_id=plan.prefill.request_id)


async def test_metadata_is_recovered_from_kwargs_when_the_render_left_it_out(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    # A renderer that sends mm_metadata null (allowed when it marks no item as metadata) must
    # not produce a prefill event without the grid: the fan-out takes it from kwargs_data.
    settings = make_settings(namespace)
    ev = renderer.render(
        "no-meta",
        prompt="<image> and <image>",
        images=[synthetic_image(56, 56, 1), synthetic_image(84, 56, 2)],
    )
    grids = [item["image_grid_thw"] for item in ev.features.kwargs_data["image"]]
    ev = dataclasses.replace(ev, features=dataclasses.replace(ev.features, mm_metadata=None))
    plan = await FanOut(settings, local_store, info).plan(ev)
    meta = plan.prefill.features.mm_metadata
    assert meta is not None and set(meta) == {"image"}
    for item, grid in zip(meta["image"], grids, strict=True):
        assert item is not None and set(item) == {"image_grid_thw"}
        assert torch.equal(item["image_grid_thw"], grid)
    validate_prefill_event(plan.prefill, ValidationConfig.from_settings(settings))


# ------------------------------------------------------------------ keys come from our own hash


def victim_and_attacker(renderer: Renderer) -> tuple[RenderEvent, RenderEvent]:
    """Two tenants' requests: the victim's image under its salt, the attacker's own image."""
    victim = renderer.render(
        "victim", prompt="<image>", images=[synthetic_image(84, 56, 51)], cache_salt="tenant-v"
    )
    attacker = renderer.render(
        "attacker", prompt="<image>", images=[synthetic_image(84, 56, 52)], cache_salt="tenant-a"
    )
    return victim, attacker


def relabel(ev: RenderEvent, label: str) -> RenderEvent:
    """``ev`` with its one image item's mm_hash replaced by ``label`` (a forged event)."""
    return dataclasses.replace(
        ev, features=dataclasses.replace(ev.features, mm_hashes={"image": [label]})
    )


async def test_forged_label_gets_no_signed_entry_and_no_cache_hit(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    # Defect: the fan-out signed whatever mm_hash a RenderEvent named, so anyone who could write
    # to the render topic got a signed entry (and a cache hit) for another tenant's embedding.
    settings = make_settings(namespace, secret=SECRET)
    fanout = FanOut(settings, store, info)
    victim, attacker = victim_and_attacker(renderer)
    (victim_hash,) = victim.features.mm_hashes["image"]
    victim_key = fanout.store_key(victim_hash)
    await store.put(victim_key, torch.full((6, 64), 7.0), ttl_s=1)

    # The victim's own request is a hit (so the attacker's misses below are not a store fluke).
    assert (await fanout.plan(victim)).cached == [victim_hash]
    await store.put(victim_key, torch.full((6, 64), 7.0), ttl_s=1)

    forged = [
        relabel(attacker, victim_hash),  # own image, victim's label
        # The victim's exact pixels under the attacker's salt, labelled with the victim's hash.
        relabel(
            dataclasses.replace(victim, request_id="attacker", cache_salt="tenant-a"), victim_hash
        ),
        relabel(dataclasses.replace(victim, request_id="attacker", cache_salt=None), victim_hash),
    ]
    for ev in forged:
        with pytest.raises(ValidationError) as err:
            await fanout.plan(ev)
        assert (err.value.rule, err.value.modality, err.value.item, err.value.field) == (
            "mm-hash-mismatch",
            "image",
            0,
            "mm_hashes",
        )
    # No hit was taken: a hit would have extended the victim's 1 s TTL to embedding_ttl_s.
    await asyncio.sleep(1.2)  # past the TTL (a functional wait, nothing is timed)
    assert not await store.exists(victim_key)


async def test_keys_and_claim_checks_use_the_fanouts_own_hash(
    renderer: Renderer, info: RenderInfo, store: EmbeddingStore, namespace: str
) -> None:
    settings = make_settings(namespace, secret=SECRET, inline_limit_bytes=0)
    fanout = FanOut(settings, store, info)
    ev = renderer.render(
        "r-own",
        prompt="<image> <image>",
        images=[synthetic_image(84, 56, 61), synthetic_image(56, 56, 62)],
        cache_salt="t1",
    )
    plan = await fanout.plan(ev)
    src = ev.features.kwargs_data["image"]  # type: ignore[index]
    for enc in plan.encode:
        item = src[enc.item_index]
        assert item is not None
        own = fanout.hasher.item_hash("image", item, "t1")
        assert enc.ec_transfer.key == f"{namespace}:{info.fingerprint}:{own}"
        ref = enc.data["pixel_values"]
        assert isinstance(ref, TensorRef) and ref.key == f"{namespace}:claim:{own}:pixel_values"
        # The claim-checked form of the item hashes the same: the ref carries its bytes' digest.
        assert fanout.hasher.item_hash("image", enc.data, "t1") == own
    # Another salt (tenant) is another key for the same pixels.
    other = renderer.render(
        "r-other",
        prompt="<image> <image>",
        images=[synthetic_image(84, 56, 61), synthetic_image(56, 56, 62)],
        cache_salt="t2",
    )
    assert not set(other.features.mm_hashes["image"]) & set(ev.features.mm_hashes["image"])


async def test_render_event_tensor_ref_must_be_its_own_claim_key(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    # A ref already in a RenderEvent is hashed by its digest; pointing it at another tenant's
    # parked inputs would get those encoded under the sender's key.
    settings = make_settings(namespace, secret=SECRET)
    fanout = FanOut(settings, local_store, info)
    ev = renderer.render("r-ref", prompt="<image>", images=[synthetic_image(84, 56, 71)])
    item = ev.features.kwargs_data["image"][0]  # type: ignore[index]
    assert item is not None
    pv = item["pixel_values"]
    assert isinstance(pv, torch.Tensor)
    (label,) = ev.features.mm_hashes["image"]
    raw = tensor_bytes(pv)

    def with_ref(key: str) -> RenderEvent:
        ref = TensorRef(
            local_store.url,
            key,
            "float32",
            list(pv.shape),
            len(raw),
            blake3.blake3(raw).hexdigest(),
        )
        kw: dict[str, list[ItemData | None]] = {"image": [{**item, "pixel_values": ref}]}
        return dataclasses.replace(ev, features=dataclasses.replace(ev.features, kwargs_data=kw))

    with pytest.raises(ValidationError) as err:
        await fanout.plan(with_ref(f"{namespace}:claim:{'0' * 64}:pixel_values"))
    assert (err.value.rule, err.value.field) == ("claim-check", "pixel_values")
    own = f"{namespace}:claim:{label}:pixel_values"
    await local_store.put_bytes(own, raw, 60)
    plan = await fanout.plan(with_ref(own))
    assert [e.mm_hash for e in plan.encode] == [label]


async def test_entries_cannot_be_replayed_into_another_request(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    settings = make_settings(namespace, secret=SECRET)
    _, plan = await plan_for(renderer, info, local_store, settings)
    config = ValidationConfig.from_settings(settings)
    validate_prefill_event(plan.prefill, config)
    for enc in plan.encode:
        validate_encode_event(enc, config)
    replayed = dataclasses.replace(plan.prefill, request_id="someone-else")
    with pytest.raises(ValidationError) as err:
        validate_prefill_event(replayed, config)
    assert err.value.rule == "ec-signature"
    with pytest.raises(ValidationError) as err:
        validate_encode_event(
            dataclasses.replace(plan.encode[0], request_id="someone-else"), config
        )
    assert (err.value.rule, err.value.item) == ("ec-signature", plan.encode[0].item_index)


# ------------------------------------------------------------------ publish order


async def test_publish_orders_the_record_before_prefill_only_when_something_is_encoded(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    # A request with an item to encode records "encoding" before its prefill event can go (a
    # prefill worker's "prefilling" must not overtake it). An all-cached request's update is
    # "prefilling" itself, so its prefill event goes out beside the record write.
    from runtime.publisher import InMemoryPublisher
    from schemas.topics import Topics

    settings = make_settings(namespace, secret=SECRET)
    topics = Topics(settings.topic_prefix)
    publisher = InMemoryPublisher()
    prefill_sent_at_record: list[bool] = []

    async def record(update: object, *, fields: object = None) -> None:
        # Give a concurrent send its turn first, then note whether the prefill event is out.
        for _ in range(5):
            await asyncio.sleep(0)
        prefill_sent_at_record.append(bool(publisher.on(topics.prefill)))

    fanout = FanOut(settings, local_store, info, publisher=publisher, topics=topics, record=record)
    ev = render(renderer, (5,))
    stats = await fanout.publish(ev)
    assert stats.encode_events == 1
    assert prefill_sent_at_record == [False]

    publisher.records.clear()
    (h,) = ev.features.mm_hashes["image"]
    await local_store.put(fanout.store_key(h), torch.zeros(6, 64), ttl_s=60)
    again = dataclasses.replace(ev, request_id=f"req-{uuid.uuid4().hex[:8]}")
    stats = await fanout.publish(again)
    assert (stats.encode_events, stats.cache_hits) == (0, 1)
    assert prefill_sent_at_record == [False, True]
    assert len(publisher.on(topics.prefill)) == 1


async def test_each_event_is_encoded_once_and_those_bytes_are_sent(
    renderer: Renderer, info: RenderInfo, local_store: LocalStore, namespace: str
) -> None:
    # The plan encodes every event to check it (rule event-encoding); publishing sends those
    # very bytes instead of encoding again.
    from runtime.publisher import InMemoryPublisher
    from schemas.codec import Codec, get_codec
    from schemas.topics import Topics

    settings = make_settings(namespace, secret=SECRET)
    topics = Topics(settings.topic_prefix)
    publisher = InMemoryPublisher()
    fanout = FanOut(settings, local_store, info, publisher=publisher, topics=topics)
    encodes: list[str] = []
    codec = get_codec()
    real = Codec.encode

    def counting(self: Codec, event: object) -> bytes:
        encodes.append(type(event).__name__)
        return real(self, event)  # type: ignore[arg-type]

    codec.encode = counting.__get__(codec)  # type: ignore[method-assign]
    try:
        await fanout.publish(render(renderer, (6,)))
    finally:
        del codec.encode  # type: ignore[attr-defined]
    assert sorted(encodes) == ["EncodeEvent", "PrefillEvent", "ResultEvent"]
    (enc,) = publisher.on(topics.encode)
    (pre,) = publisher.on(topics.prefill)
    assert isinstance(enc.event(), EncodeEvent) and isinstance(pre.event(), PrefillEvent)
