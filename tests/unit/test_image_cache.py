"""The processed-image cache: an image sent again is not decoded or processed again, and
renders to the very same event; the cache is bounded and never hands out changed tensors."""

from __future__ import annotations

import io

import pytest
import torch

from media.image_decoder import ImageDecoder
from media.sample_images import synthetic_image
from producers.image_cache import ProcessedImage, ProcessedImages, image_key
from producers.render import Renderer
from runtime.model import load_render_info
from runtime.settings import Settings


def png(seed: int, size: int = 112) -> bytes:
    out = io.BytesIO()
    synthetic_image(size, size, seed=seed).save(out, "PNG")
    return out.getvalue()


def outputs(n: int, rows: int = 16) -> ProcessedImage:
    return ProcessedImage(torch.full((rows, 8), float(n)), torch.tensor([1, 4, rows // 4]))


def test_the_cache_is_bounded_by_bytes_least_recently_used_first_out() -> None:
    one = outputs(0).nbytes
    cache = ProcessedImages(3 * one)
    for n in range(3):
        cache.put(bytes([n]), outputs(n))
    assert cache.get(bytes([0])) is not None  # 0 is now the most recently used
    cache.put(bytes([3]), outputs(3))
    assert cache.get(bytes([1])) is None and cache.get(bytes([0])) is not None
    assert len(cache) == 3 and cache.nbytes == 3 * one
    cache.put(b"big", outputs(9, rows=64))  # alone over the bound: not kept
    assert cache.get(b"big") is None and cache.nbytes <= cache.max_bytes


def test_tensors_changed_in_place_are_never_handed_out() -> None:
    cache = ProcessedImages(1 << 20)
    kept = outputs(1)
    cache.put(b"k", kept)
    kept.pixel_values.add_(1)
    assert cache.get(b"k") is None and len(cache) == 0


def test_off_at_zero_bytes() -> None:
    cache = ProcessedImages(0)
    assert not cache.enabled
    cache.put(b"k", outputs(1))
    assert cache.get(b"k") is None


@pytest.fixture
async def renderer() -> Renderer:
    r = Renderer.for_settings(load_render_info("instant"), Settings())
    r.decoder = ImageDecoder(r.image_limits, 1)
    await r.decoder.start()
    yield r
    await r.decoder.close()


async def test_an_image_sent_again_renders_the_same_without_a_decode(renderer: Renderer) -> None:
    data = png(3)
    first = await renderer.render_async("a", prompt="<image> and <image>", images=[data, png(4)])
    assert renderer.processed.hits == 0 and len(renderer.processed) == 2

    async def no_decode(*args: object, **kwargs: object) -> None:
        raise AssertionError("a kept image was decoded again")

    renderer.decoder.decode = no_decode  # type: ignore[assignment, method-assign]
    again = await renderer.render_async("b", prompt="<image> and <image>", images=[data, png(4)])
    assert renderer.processed.hits == 2
    assert again.token_ids == first.token_ids
    assert again.features.mm_hashes == first.features.mm_hashes
    for a, b in zip(
        first.features.kwargs_data["image"], again.features.kwargs_data["image"], strict=True
    ):
        assert torch.equal(a["pixel_values"], b["pixel_values"])
        assert torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    # The tenant's salt still makes its own hash of the same kept outputs.
    salted = await renderer.render_async("c", prompt="<image>", images=[data], cache_salt="t2")
    assert salted.features.mm_hashes["image"][0] != first.features.mm_hashes["image"][0]


async def test_a_refused_image_is_not_kept(renderer: Renderer) -> None:
    bad = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64
    with pytest.raises(Exception, match="image"):
        await renderer.render_async("a", prompt="<image>", images=[bad])
    assert len(renderer.processed) == 0 and image_key(bad) not in renderer.processed._items


def test_only_a_render_of_kept_images_and_a_short_prompt_stays_on_the_loop() -> None:
    from producers.render import INLINE_RENDER_SIZE, _light

    kept = outputs(1)
    short, long = "<image> hi", "<image>" + "x" * INLINE_RENDER_SIZE
    assert _light({"prompt": short, "images": [kept, kept]})
    assert _light({"token_ids": [1] * INLINE_RENDER_SIZE, "images": [kept]})
    assert _light({"prompt": short})  # text alone
    assert not _light({"prompt": long, "images": [kept]})  # tokenising it takes a while
    assert not _light({"token_ids": [1] * (INLINE_RENDER_SIZE + 1)})
    assert not _light({"prompt": short, "images": [kept, png(1)]})  # one still to process
    assert not _light({"prompt": short, "videos": [b"..."]})


async def test_a_render_on_the_loop_refuses_a_bad_prompt_with_its_rule(renderer: Renderer) -> None:
    from producers.render_errors import RenderError

    data = png(5)
    await renderer.render_async("a", prompt="<image>", images=[data])  # now kept
    with pytest.raises(RenderError) as markers:  # two markers, one (kept) image
        await renderer.render_async("b", prompt="<image> <image>", images=[data])
    assert markers.value.rule == "render.marker_count" and renderer.processed.hits == 1
    with pytest.raises(RenderError) as neither:
        await renderer.render_async("c", images=[data])
    assert neither.value.rule == "render.prompt"
