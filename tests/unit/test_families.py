"""The supported model families (schemas/families.py), each on its seeded tiny model, CPU fp32.

Parity: the disaggregated path (encode_items -> store-shaped entries -> prefill/decode) gives
exactly the tokens of ``model.generate`` for single image, two images, repeated image and image +
video, for Qwen2-VL, Qwen2.5-VL (window attention, video timing) and Qwen3-VL (deepstack). Video
inputs are built as tensors with the processors' published patching rules (the renderer does not
take video yet); they run through the compute functions and, below, through the real encode and
prefill workers.
"""

from __future__ import annotations

import inspect
import json
import shutil
import uuid
from collections.abc import AsyncIterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import SecretStr

from epd.cli import main as epd_main
from gpu_workers.compute import (
    ComputeError,
    ItemEmbedding,
    encode_images,
    encode_items,
    item_embedding,
    mrope_positions,
)
from gpu_workers.context import WorkerContext
from gpu_workers.encode import EncodeWorker
from gpu_workers.engine import generate_from_embeddings
from gpu_workers.oracle import generate_monolithic, monolithic_inputs
from gpu_workers.prefill import PrefillWorker
from producers.fanout import build_fanout
from producers.render import Renderer
from runtime.model import (
    FAMILY_CLASSES,
    ModelBundle,
    ModelLoadError,
    load_model,
    load_render_info,
    model_family,
)
from runtime.publisher import InMemoryPublisher
from runtime.settings import Settings
from runtime.stores.redis import RedisStore
from schemas.errors import ValidationError
from schemas.families import DEEPSTACK, EMBEDS, FAMILIES
from schemas.topics import Topics
from schemas.types import (
    Features,
    PlaceholderRange,
    PrefillEvent,
    RenderEvent,
    ResultEvent,
    SamplingParams,
)

MAX_TOKENS = 10
SPECS = [f.tiny_spec for f in FAMILIES.values()]  # tiny, tiny-qwen2.5-vl, tiny-qwen3-vl(-moe)


@cache
def bundle_of(spec: str) -> ModelBundle:
    return load_model(spec, device="cpu")


@cache
def renderer_of(spec: str) -> Renderer:
    return Renderer(bundle_of(spec), max_image_pixels=10**8)


def rand_image(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8"))


def video_inputs(
    bundle: ModelBundle, frames: int, h_patches: int, w_patches: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel_values_videos, video_grid_thw)`` of random normalised frames, patched by the
    Qwen2-VL video processor's rule: frames grouped by ``temporal_patch_size``, patches ordered
    (t, h-block, w-block, h-in-block, w-in-block), each row C x T x P x P."""
    p = bundle.image_processor
    ps, m, tps = p.patch_size, p.merge_size, p.temporal_patch_size
    rng = np.random.RandomState(seed)
    x = torch.from_numpy(rng.randn(frames, 3, h_patches * ps, w_patches * ps).astype("float32"))
    gt, gh, gw = frames // tps, h_patches, w_patches
    x = x.reshape(gt, tps, 3, gh // m, m, ps, gw // m, m, ps).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, 3 * tps * ps * ps).contiguous(), torch.tensor([gt, gh, gw])


def image_items(bundle: ModelBundle, event: RenderEvent) -> list[ItemEmbedding]:
    """What a prefill worker builds for the event's images: outputs + placeholders + metadata."""
    f = event.features
    data = f.kwargs_data["image"]
    outs = encode_items(bundle, [(d["pixel_values"], d["image_grid_thw"]) for d in data])
    return [
        item_embedding("image", r.offset, r.length, o, m)
        for r, o, m in zip(f.mm_placeholders["image"], outs, f.mm_metadata["image"], strict=True)
    ]


IMAGE_CASES = {
    "single": ("Describe <image> please.", [(100, 150, 1)]),
    "two_images": ("First <image> then <image> compare.", [(100, 150, 1), (224, 224, 2)]),
    "repeated": ("A <image> and again <image>.", [(90, 90, 3), (90, 90, 3)]),
}


@pytest.mark.parametrize("case", sorted(IMAGE_CASES))
@pytest.mark.parametrize("spec", SPECS)
def test_image_parity_per_family(spec: str, case: str) -> None:
    bundle, renderer = bundle_of(spec), renderer_of(spec)
    prompt, sizes = IMAGE_CASES[case]
    event = renderer.render(case, prompt=prompt, images=[rand_image(*s) for s in sizes])
    ids, pv, grid = monolithic_inputs(event)
    want = generate_monolithic(bundle, ids, pv, grid, MAX_TOKENS, ignore_eos=True)
    got = generate_from_embeddings(
        bundle, event.token_ids, image_items(bundle, event), MAX_TOKENS, ignore_eos=True
    )
    assert got == want and len(got) == MAX_TOKENS


def image_and_video(spec: str) -> tuple[list[int], list[ItemEmbedding], dict, dict]:
    """An image then a video (Qwen2.5-VL: with timing). Returns token ids, the disaggregated
    items, the oracle's keyword arguments and the video item's metadata."""
    bundle, renderer = bundle_of(spec), renderer_of(spec)
    event = renderer.render("iv", prompt="see <image> and", images=[rand_image(100, 150, 5)])
    fam = bundle.family
    frames = 2 if fam.video_timestamps else 4  # Qwen3-VL: one temporal row per run
    vpv, vgrid = video_inputs(bundle, frames, 4, 6, seed=9)
    n = int(vgrid.prod()) // bundle.merge_size**2
    ids = [*event.token_ids, bundle.vision_start_id]
    offset = len(ids)
    ids += [bundle.video_token_id] * n + [bundle.vision_end_id] + list(b" ok")
    meta: dict = {"video_grid_thw": vgrid}
    if "second_per_grid_ts" in fam.metadata["video"]:
        meta["second_per_grid_ts"] = torch.tensor([1.5])
    _, pv, grid = monolithic_inputs(event)
    oracle_kw = {
        "pixel_values": pv,
        "image_grid_thw": grid,
        "pixel_values_videos": vpv,
        "video_grid_thw": vgrid,
        "second_per_grid_ts": meta.get("second_per_grid_ts"),
    }
    img = event.features.kwargs_data["image"][0]
    outs = encode_items(bundle, [(img["pixel_values"], img["image_grid_thw"]), (vpv, vgrid)])
    ph = event.features.mm_placeholders["image"][0]
    items = [
        item_embedding("image", ph.offset, ph.length, outs[0], {"image_grid_thw": grid[0]}),
        item_embedding("video", offset, n, outs[1], meta),
    ]
    return ids, items, oracle_kw, meta


def oracle(spec: str, ids: list[int], kw: dict) -> list[int]:
    kw = dict(kw)
    pv, grid = kw.pop("pixel_values"), kw.pop("image_grid_thw")
    return generate_monolithic(bundle_of(spec), ids, pv, grid, MAX_TOKENS, ignore_eos=True, **kw)


@pytest.mark.parametrize("spec", SPECS)
def test_image_and_video_parity_per_family(spec: str) -> None:
    ids, items, kw, _ = image_and_video(spec)
    want = oracle(spec, ids, kw)
    assert generate_from_embeddings(bundle_of(spec), ids, items, MAX_TOKENS, ignore_eos=True) == (
        want
    )


def test_qwen2_5_vl_video_timing_drives_positions() -> None:
    """second_per_grid_ts spaces the video's temporal positions by timing x tokens_per_second;
    leaving it out (or changing it) changes the positions and the tokens."""
    spec = "tiny-qwen2.5-vl"
    bundle = bundle_of(spec)
    ids, items, kw, _ = image_and_video(spec)
    want = oracle(spec, ids, kw)
    video = items[1]
    pos, _ = mrope_positions(bundle, ids, items)
    t_axis = pos[0, 0, video.offset : video.offset + video.length]
    rows = int(video.grid_thw[0])
    per_row = video.length // rows
    step = int(bundle.config.vision_config.tokens_per_second * 1.5)
    assert step == 3
    assert int(t_axis[per_row] - t_axis[0]) == step  # second temporal row, not +1

    for other in ({}, {"second_per_grid_ts": torch.tensor([0.5])}):
        video.metadata = other
        got = generate_from_embeddings(bundle, ids, items, MAX_TOKENS, ignore_eos=True)
        assert got != want, other
    video.metadata = {"second_per_grid_ts": torch.tensor([float("nan")])}
    with pytest.raises(ComputeError, match="second_per_grid_ts"):
        generate_from_embeddings(bundle, ids, items, 1)


def test_qwen2_5_vl_vision_tower_uses_windows() -> None:
    """The tiny Qwen2.5-VL has a windowed block: an image larger than one window gives
    different embeddings when every block attends fully."""
    bundle = bundle_of("tiny-qwen2.5-vl")
    vc = bundle.config.vision_config
    assert 0 not in vc.fullatt_block_indexes and vc.window_size < 224
    event = renderer_of("tiny-qwen2.5-vl").render(
        "w", prompt="<image>", images=[rand_image(224, 224, 7)]
    )
    d = event.features.kwargs_data["image"][0]
    windowed = encode_items(bundle, [(d["pixel_values"], d["image_grid_thw"])])[0][EMBEDS]
    visual = bundle.model.model.visual
    saved = visual.fullatt_block_indexes
    visual.fullatt_block_indexes = list(range(vc.depth))
    try:
        full = encode_items(bundle, [(d["pixel_values"], d["image_grid_thw"])])[0][EMBEDS]
    finally:
        visual.fullatt_block_indexes = saved
    assert not torch.allclose(windowed, full, atol=1e-4)


def test_qwen3_vl_deepstack_is_part_of_the_item() -> None:
    """Each item carries (layers, tokens, hidden) deepstack features; zeroed, the tokens differ
    from generate (so the parity above really covers them), and missing ones are refused."""
    spec = "tiny-qwen3-vl"
    bundle = bundle_of(spec)
    event = renderer_of(spec).render(
        "ds",
        prompt="a <image> b <image> c",
        images=[rand_image(96, 96, 11), rand_image(96, 96, 12)],
    )
    ids, pv, grid = monolithic_inputs(event)
    want = generate_monolithic(bundle, ids, pv, grid, MAX_TOKENS, ignore_eos=True)
    items = image_items(bundle, event)
    layers = len(bundle.config.vision_config.deepstack_visual_indexes)
    for it in items:
        assert it.deepstack is not None
        assert tuple(it.deepstack.shape) == (layers, it.length, 64)
    assert generate_from_embeddings(bundle, ids, items, MAX_TOKENS, ignore_eos=True) == want

    zeroed = [ItemEmbedding(**{**_fields(it), "deepstack": torch.zeros_like(it.deepstack)})
              for it in items]  # fmt: skip
    assert generate_from_embeddings(bundle, ids, zeroed, MAX_TOKENS, ignore_eos=True) != want

    missing = [ItemEmbedding(**{**_fields(items[0]), "deepstack": None}), items[1]]
    with pytest.raises(ComputeError, match="deepstack"):
        generate_from_embeddings(bundle, ids, missing, 1)
    # Main embeddings alone are refused for a deepstack family...
    with pytest.raises(ComputeError, match="use encode_items"):
        encode_images(bundle, [(pv[: int(grid[0].prod())], grid[0])])
    # ...and a family without deepstack refuses features rather than ignoring them.
    q2 = bundle_of("tiny")
    ev2 = renderer_of("tiny").render("q2", prompt="<image>", images=[rand_image(56, 56, 13)])
    (plain,) = image_items(q2, ev2)
    plain.deepstack = torch.zeros(2, plain.length, 64)
    with pytest.raises(ComputeError, match="has no deepstack"):
        generate_from_embeddings(q2, ev2.token_ids, [plain], 1)


def _fields(it: ItemEmbedding) -> dict:
    return {k: getattr(it, k) for k in ItemEmbedding.__slots__}


def test_qwen3_vl_video_runs_are_one_temporal_row() -> None:
    bundle = bundle_of("tiny-qwen3-vl")
    vpv, vgrid = video_inputs(bundle, 4, 4, 4, seed=3)  # two temporal rows in one run
    (out,) = encode_items(bundle, [(vpv, vgrid)])
    n = int(vgrid.prod()) // 4
    ids = [1, bundle.vision_start_id, *([bundle.video_token_id] * n), bundle.vision_end_id]
    item = item_embedding("video", 2, n, out, {"video_grid_thw": vgrid})
    with pytest.raises(ComputeError, match="temporal grid row"):
        generate_from_embeddings(bundle, ids, [item], 1)


@pytest.mark.parametrize("spec", SPECS)
def test_family_table_matches_the_model(spec: str) -> None:
    """The table's facts hold for the transformers model: merge size, placeholder token ids,
    get_rope_index accepts every rope argument, deepstack iff the vision tower has taps."""
    bundle = bundle_of(spec)
    fam = bundle.family
    assert fam.tiny_spec == spec and type(bundle.model) is FAMILY_CLASSES[fam.model_type].model
    assert bundle.merge_size == fam.default_merge_size
    tok = bundle.tokenizer
    assert tok.convert_tokens_to_ids(fam.placeholder_tokens["image"]) == bundle.image_token_id
    assert tok.convert_tokens_to_ids(fam.placeholder_tokens["video"]) == bundle.video_token_id
    params = inspect.signature(bundle.model.model.get_rope_index).parameters
    assert all(a.name in params for a in fam.rope_args)
    taps = getattr(bundle.config.vision_config, "deepstack_visual_indexes", None)
    assert fam.has_deepstack == bool(taps)


# ---------------------------------------------------------------------------------------------
# identity and loading


def test_families_never_share_identity() -> None:
    """Same image, same salt: every family has its own fingerprint, hence its own mm_hash and
    its own store key."""
    img = rand_image(84, 84, 1)
    fps, hashes = set(), set()
    for spec in SPECS:
        info = load_render_info(spec)
        assert info.family is FAMILIES[TINY_TYPE[spec]]
        fps.add(info.fingerprint)
        ev = Renderer(info, max_image_pixels=10**8).render("x", prompt="<image>", images=[img])
        hashes.add(ev.features.mm_hashes["image"][0])
    assert len(fps) == len(hashes) == len(SPECS)


TINY_TYPE = {f.tiny_spec: k for k, f in FAMILIES.items()}


def save_tiny(spec: str, path: Path) -> Path:
    b = bundle_of(spec)
    b.model.save_pretrained(path)
    b.tokenizer.save_pretrained(path)
    b.image_processor.save_pretrained(path)
    return path


@pytest.mark.parametrize("spec", ["tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-qwen3-vl-moe"])
def test_checkpoint_of_each_family_loads_offline(spec: str, tmp_path: Path) -> None:
    """A saved tiny checkpoint loads through ``load_model(PATH)`` as its own family and
    generates the tiny model's tokens from the disaggregated path."""
    path = save_tiny(spec, tmp_path / "ckpt")
    loaded = load_model(str(path), device="cpu")
    info = load_render_info(str(path))
    assert loaded.family is info.family is bundle_of(spec).family
    assert loaded.fingerprint == info.fingerprint != bundle_of(spec).fingerprint
    event = Renderer(info, max_image_pixels=10**8).render(
        "ck", prompt="saved <image> model", images=[rand_image(100, 150, 51)]
    )
    ids, pv, grid = monolithic_inputs(event)
    want = generate_monolithic(bundle_of(spec), ids, pv, grid, MAX_TOKENS, ignore_eos=True)
    got = generate_from_embeddings(
        loaded, ids, image_items(loaded, event), MAX_TOKENS, ignore_eos=True
    )
    assert got == want


def test_unsupported_or_broken_checkpoints_are_refused(tmp_path: Path, capsys) -> None:
    """Another model_type is refused up front, naming every supported one; a checkpoint whose
    weights do not fit its declared family is a ModelLoadError, not a RuntimeError."""
    other = tmp_path / "llava"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llava"}))
    with pytest.raises(ModelLoadError) as info:
        model_family(str(other))
    for t in FAMILIES:
        assert t in str(info.value)
    with pytest.raises(ModelLoadError, match="llava"):
        load_render_info(str(other))
    with pytest.raises(ModelLoadError, match="llava"):
        load_model(str(other), device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="cannot read"):
        model_family(str(tmp_path / "empty"))
    (other / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        model_family(str(other))
    (other / "config.json").write_text(json.dumps({"model_type": "llava"}))

    # The CLI: one line and exit code 2, before any service or worker starts.
    for argv in (["worker", "encode", "--model", str(other)], ["demo", "--model", str(other)]):
        assert epd_main(argv) == 2
        err = capsys.readouterr().err
        assert "model_type 'llava' is not supported" in err and "qwen3_vl" in err
        assert "Traceback" not in err
    assert epd_main(["verify", "--model", "tiny-qwen4"]) == 2
    assert "tiny-qwen3-vl" in capsys.readouterr().err

    # The case: Qwen2.5-VL weights under a Qwen2-VL config (the shapes do not fit).
    mixed = save_tiny("tiny-qwen2.5-vl", tmp_path / "mixed")
    cfg = json.loads((mixed / "config.json").read_text())
    cfg["model_type"] = "qwen2_vl"
    (mixed / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="Qwen2-VL checkpoint"):
        load_model(str(mixed), device="cpu")
    shutil.rmtree(mixed)


# ---------------------------------------------------------------------------------------------
# the workers: encode -> Redis -> prefill, per family, in-process (no broker)


@pytest.fixture
async def redis_store(settings: Settings) -> AsyncIterator[tuple[RedisStore, str]]:
    """A Redis store on the session's test Redis (the ``settings`` fixture starts it: a
    ``Settings()`` read alone would point at localhost:6379 when this test runs first)."""
    import redis.asyncio as aioredis

    url = settings.redis_url
    namespace = f"ec-fam-{uuid.uuid4().hex[:10]}"
    store = RedisStore(url)
    try:
        yield store, namespace
    finally:
        client = aioredis.Redis.from_url(url)
        keys = [k async for k in client.scan_iter(match=f"{namespace}:*", count=500)]
        if keys:
            await client.delete(*keys)
        await client.aclose()
        await store.close()


def _settings(namespace: str) -> Settings:
    return Settings(
        topic_prefix=f"fam-{uuid.uuid4().hex[:8]}",
        ec_namespace=namespace,
        ec_secret=SecretStr("families-secret"),
        inline_limit_bytes=1 << 30,
        validation_mode="strict",
    )


def with_video(spec: str, event: RenderEvent, frames_seed: int = 9) -> tuple[RenderEvent, dict]:
    """``event`` plus a trailing video item (full data + metadata), as a renderer would emit."""
    bundle, renderer = bundle_of(spec), renderer_of(spec)
    fam = bundle.family
    vpv, vgrid = video_inputs(bundle, 2 if fam.video_timestamps else 4, 4, 6, frames_seed)
    n = int(vgrid.prod()) // bundle.merge_size**2
    ids = [*event.token_ids, bundle.vision_start_id]
    offset = len(ids)
    ids += [bundle.video_token_id] * n + [bundle.vision_end_id, 33]
    meta: dict = {"video_grid_thw": vgrid}
    if "second_per_grid_ts" in fam.metadata["video"]:
        meta["second_per_grid_ts"] = torch.tensor([1.5])
    f = event.features
    h = renderer.mm_hash("video", {"pixel_values_videos": vpv, **meta}, event.cache_salt)
    features = Features(
        mm_hashes={**f.mm_hashes, "video": [h]},
        mm_placeholders={**f.mm_placeholders, "video": [PlaceholderRange(offset, n)]},
        kwargs_data={**(f.kwargs_data or {}), "video": [{"pixel_values_videos": vpv, **meta}]},
        mm_metadata={**(f.mm_metadata or {}), "video": [meta]},
    )
    ev = RenderEvent(
        request_id=event.request_id,
        model=event.model,
        token_ids=ids,
        features=features,
        sampling=event.sampling,
        cache_salt=event.cache_salt,
    )
    return ev, {"pixel_values_videos": vpv, **meta}


async def run_pipeline(
    spec: str, event: RenderEvent, store: RedisStore, namespace: str, **prefill_options: Any
):
    """Fan-out -> encode worker -> Redis -> prefill worker, in-process; the prefill's result.
    ``prefill_options`` go to the prefill worker (e.g. ``streams``)."""
    settings = _settings(namespace)
    topics = Topics(settings.topic_prefix)
    bundle = bundle_of(spec)
    pub = InMemoryPublisher()
    fanout = build_fanout(settings, store, bundle.render_info(), pub)
    await fanout.publish(event)
    encoder = EncodeWorker(WorkerContext(settings, bundle, store, pub, worker_id="enc-fam"))
    prefiller = PrefillWorker(
        WorkerContext(settings, bundle, store, pub, worker_id="pre-fam"),
        embedding_wait_s=30,
        **prefill_options,
    )
    try:
        for enc in pub.events(topics.encode):
            await encoder.handle(enc)
        (prefill_ev,) = pub.events(topics.prefill)
        assert isinstance(prefill_ev, PrefillEvent)
        await prefiller.handle(prefill_ev)
    finally:
        await encoder.close()
        await prefiller.close()
    done = [e for e in pub.events(topics.results) if isinstance(e, ResultEvent)]
    return done[-1], prefill_ev, settings


@pytest.mark.parametrize("spec", ["tiny-qwen2.5-vl", "tiny-qwen3-vl"])
async def test_workers_image_and_video_match_generate(
    spec: str, redis_store: tuple[RedisStore, str]
) -> None:
    """The real workers over Redis, image + video: Qwen3-VL's entries hold embedding and
    deepstack together (one key each), Qwen2.5-VL's video timing reaches the positions."""
    store, namespace = redis_store
    bundle, renderer = bundle_of(spec), renderer_of(spec)
    base = renderer.render(
        f"w-{spec}",
        prompt="look <image> then",
        images=[rand_image(100, 150, 5)],
        sampling=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    event, video = with_video(spec, base)
    result, prefill_ev, _ = await run_pipeline(spec, event, store, namespace)
    assert result.status == "completed", result.error

    _, pv, grid = monolithic_inputs(base)
    want = generate_monolithic(
        bundle, event.token_ids, pv, grid, MAX_TOKENS, ignore_eos=True,
        pixel_values_videos=video["pixel_values_videos"], video_grid_thw=video["video_grid_thw"],
        second_per_grid_ts=video.get("second_per_grid_ts"),
    )  # fmt: skip
    assert result.token_ids == want

    keys = [prefill_ev.ec_transfer_params[h].key for _, _, h in event.features.items()]
    if bundle.family.has_deepstack:
        entries = await store.get_tensors_many(keys)
        assert all(set(e) == {EMBEDS, DEEPSTACK} for e in entries)
    else:
        assert "second_per_grid_ts" in prefill_ev.features.mm_metadata["video"][0]
        assert all(t.dim() == 2 for t in await store.get_many(keys))


async def test_prefill_of_one_family_rejects_another_familys_event(
    redis_store: tuple[RedisStore, str],
) -> None:
    """An event rendered and fanned out for Qwen2-VL reaches a Qwen3-VL prefill worker: refused
    by rule ec-key (its keys carry the other model's fingerprint), nothing is read or run."""
    store, namespace = redis_store
    settings = _settings(namespace)
    topics = Topics(settings.topic_prefix)
    pub = InMemoryPublisher()
    fanout = build_fanout(settings, store, bundle_of("tiny").render_info(), pub)
    event = renderer_of("tiny").render("x", prompt="<image>", images=[rand_image(84, 84, 2)])
    await fanout.publish(event)
    (prefill_ev,) = pub.events(topics.prefill)
    worker = PrefillWorker(
        WorkerContext(settings, bundle_of("tiny-qwen3-vl"), store, pub, worker_id="p3")
    )
    try:
        with pytest.raises(ValidationError) as info:
            await worker.handle(prefill_ev)
    finally:
        await worker.close()
    assert info.value.rule == "ec-key"
    assert worker.tally.completed == 0

    # Qwen2.5-VL's video timing is not a metadata field of Qwen2-VL: rule named, not ignored.
    base = renderer_of("tiny").render("t", prompt="<image>", images=[rand_image(84, 84, 3)])
    event, _ = with_video("tiny", base)
    event.features.mm_metadata["video"][0]["second_per_grid_ts"] = torch.tensor([1.5])
    pub.records.clear()
    await fanout.publish(event)
    (prefill_ev,) = pub.events(topics.prefill)
    q2 = PrefillWorker(WorkerContext(settings, bundle_of("tiny"), store, pub, worker_id="p2"))
    try:
        with pytest.raises(ValidationError) as info:
            await q2.handle(prefill_ev)
    finally:
        await q2.close()
    assert (info.value.rule, info.value.modality, info.value.field) == (
        "metadata-field",
        "video",
        "second_per_grid_ts",
    )
