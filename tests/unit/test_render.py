"""Renderer: token layout, placeholders, hashes, features shape, and bad-image handling."""

from __future__ import annotations

import io
import itertools
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpu_workers.oracle import monolithic_inputs
from media.pictures import IMAGE_FORMATS
from producers.prompt_tokens import QWEN_IMAGE_BLOCK
from producers.render import Renderer, _Item, build_features
from producers.render_errors import RenderError
from runtime.model import RenderInfo, load_render_info
from schemas.errors import ValidationError
from schemas.types import SamplingParams


def rand_image(h: int, w: int, seed: int = 0) -> Image.Image:
    rng = np.random.RandomState(seed)
    return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims a size in its header but holds no pixel data (a bomb's shape)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def info() -> RenderInfo:
    return load_render_info("tiny")


@pytest.fixture(scope="module")
def renderer(info: RenderInfo) -> Renderer:
    return Renderer(info, max_image_pixels=4096 * 4096)


@pytest.mark.parametrize(
    "size", [(56, 56), (100, 150), (224, 224), (30, 40), (60, 200), (500, 300)]
)
def test_placeholder_layout(renderer: Renderer, info: RenderInfo, size: tuple[int, int]) -> None:
    ev = renderer.render("r", prompt="look <image> now", images=[rand_image(*size)])
    f = ev.features
    grid = f.kwargs_data["image"][0]["image_grid_thw"]
    t, h, w = grid.tolist()
    n = t * h * w // info.merge_size**2
    (ph,) = f.mm_placeholders["image"]
    assert ph.length == n > 0
    assert ev.token_ids[ph.offset - 1] == info.vision_start_id
    assert ev.token_ids[ph.offset + n] == info.vision_end_id
    assert ev.token_ids[ph.offset : ph.offset + n] == [info.image_token_id] * n
    assert ev.token_ids.count(info.image_token_id) == n
    pv = f.kwargs_data["image"][0]["pixel_values"]
    assert pv.shape[0] == t * h * w
    assert torch.equal(f.mm_metadata["image"][0]["image_grid_thw"], grid)
    assert set(f.mm_metadata["image"][0]) == {"image_grid_thw"}
    text = info.tokenizer.decode(ev.token_ids[: ph.offset - 1])
    assert text == "look "


def test_features_share_order_and_placeholders_do_not_overlap(renderer: Renderer) -> None:
    imgs = [rand_image(56, 56, 1), rand_image(224, 100, 2), rand_image(56, 56, 1)]
    ev = renderer.render("r", prompt="<image>a<image>b<image>", images=imgs)
    f = ev.features
    assert set(f.mm_hashes) == set(f.mm_placeholders) == set(f.kwargs_data) == set(f.mm_metadata)
    assert len(f.mm_hashes["image"]) == len(f.mm_placeholders["image"]) == 3
    ranges = f.mm_placeholders["image"]
    for a, b in itertools.pairwise(ranges):
        assert a.offset + a.length < b.offset
    assert ev.token_ids[0] == renderer.info.vision_start_id
    assert ev.token_ids[-1] == renderer.info.vision_end_id
    # Same pixels -> same hash; different pixels -> different hash.
    h = f.mm_hashes["image"]
    assert h[0] == h[2] != h[1]


def test_token_ids_input_matches_prompt_input(renderer: Renderer, info: RenderInfo) -> None:
    img = rand_image(100, 150, 3)
    by_prompt = renderer.render("a", prompt="hi <image> there", images=[img])
    tok = info.tokenizer
    hi, there = (
        tok.encode("hi ", add_special_tokens=False),
        tok.encode(" there", add_special_tokens=False),
    )
    wrapped = [*hi, info.vision_start_id, info.image_token_id, info.vision_end_id, *there]
    bare = [*hi, info.image_token_id, *there]
    for ids in (wrapped, bare):
        ev = renderer.render("b", token_ids=ids, images=[img])
        assert ev.token_ids == by_prompt.token_ids
        assert ev.features.mm_hashes == by_prompt.features.mm_hashes
    aliased = renderer.render("c", prompt=f"hi {QWEN_IMAGE_BLOCK} there", images=[img])
    assert aliased.token_ids == by_prompt.token_ids


def test_hash_inputs(renderer: Renderer, info: RenderInfo) -> None:
    img = rand_image(80, 80, 4)

    def one(src, salt=None) -> str:
        return renderer.render(
            "h", prompt="<image>", images=[src], cache_salt=salt
        ).features.mm_hashes["image"][0]

    base = one(img)
    assert one(png_bytes(img)) == base  # the same pixels via bytes
    assert one(img, "tenant-a") != base
    assert one(img, "tenant-a") != one(img, "tenant-b")
    assert one(img, "") != base  # an empty salt is still a salt
    changed = np.asarray(img).copy()
    changed[0, 0, 0] ^= 0xFF
    assert one(Image.fromarray(changed)) != base
    other_model = RenderInfo(
        **{**{k: getattr(info, k) for k in info.__slots__}, "fingerprint": "x"}
    )
    assert (
        Renderer(other_model, max_image_pixels=10**6)
        .render("h", prompt="<image>", images=[img])
        .features.mm_hashes["image"][0]
        != base
    )


def test_event_fields(renderer: Renderer) -> None:
    sp = SamplingParams(max_tokens=5, stop_token_ids=[7], ignore_eos=True)
    ev = renderer.render(
        "req-1", prompt="<image>", images=[rand_image(56, 56)], sampling=sp, deadline_ms=123,
        cache_salt="s",
    )  # fmt: skip
    assert (ev.request_id, ev.model, ev.sampling, ev.deadline_ms, ev.cache_salt) == (
        "req-1", "tiny", sp, 123, "s",
    )  # fmt: skip
    ids, pv, grid = monolithic_inputs(ev)
    assert ids == ev.token_ids and grid.shape == (1, 3) and pv.shape[0] == int(grid.prod())


def test_text_only_prompt(renderer: Renderer) -> None:
    ev = renderer.render("t", prompt="just text")
    assert ev.features.mm_hashes == {} and ev.features.kwargs_data is None
    assert ev.features.mm_metadata is None
    assert monolithic_inputs(ev) == (ev.token_ids, None, None)


def test_slots_across_modalities() -> None:
    g = torch.tensor([1, 2, 2])
    img = _Item("image", "h1", 0, 1, {"pixel_values": torch.zeros(4, 3), "image_grid_thw": g},
                {"image_grid_thw": g})  # fmt: skip
    audio = _Item("audio", "h2", 3, 2, {"input_features": torch.zeros(2, 2)}, None)
    f = build_features([img, audio])
    assert set(f.mm_metadata) == {"image", "audio"}
    assert f.mm_metadata["audio"] == [None]
    assert len(f.mm_metadata["image"]) == 1
    img.metadata = None
    assert build_features([img, audio]).mm_metadata is None


@pytest.mark.parametrize(
    ("kwargs", "rule"),
    [
        ({"prompt": "<image> and <image>", "n": 1}, "render.marker_count"),
        ({"prompt": "no marker", "n": 1}, "render.marker_count"),
        ({"prompt": "<image>", "n": 2}, "render.marker_count"),
        ({"prompt": "sneaky <|image_pad|> <image>", "n": 1}, "render.reserved_token"),
        ({"token_ids": [1, 2, 3], "n": 1}, "render.marker_count"),
        ({"token_ids": [1, -2], "n": 0}, "render.token_ids"),
        ({"token_ids": [1, 10**9], "n": 0}, "render.token_ids"),
        ({"prompt": "", "n": 0}, "render.prompt"),
        ({"n": 0}, "render.prompt"),
        ({"prompt": "x", "token_ids": [1], "n": 0}, "render.prompt"),
    ],
)
def test_prompt_errors(renderer: Renderer, kwargs: dict, rule: str) -> None:
    n = kwargs.pop("n")
    with pytest.raises(RenderError) as ei:
        renderer.render("e", images=[rand_image(56, 56)] * n, **kwargs)
    assert ei.value.rule == rule
    assert isinstance(ei.value, ValidationError)


def test_oversize_image_is_refused_before_decoding(renderer: Renderer) -> None:
    # Header claims 6000x6000 (above our 4096² limit, below PIL's own bomb limit).
    with pytest.raises(RenderError) as ei:
        renderer.render("b", prompt="<image>", images=[png_header_only(6000, 6000)])
    assert ei.value.rule == "render.image_too_large" and ei.value.item == 0
    small = Renderer(renderer.info, max_image_pixels=64 * 64)
    with pytest.raises(RenderError) as ei:
        small.render(
            "b", prompt="<image> <image>", images=[rand_image(56, 56), rand_image(100, 100)]
        )
    assert (ei.value.rule, ei.value.item, ei.value.modality) == (
        "render.image_too_large",
        1,
        "image",
    )


def test_decompression_bomb_caught_even_with_a_high_limit(renderer: Renderer) -> None:
    lax = Renderer(renderer.info, max_image_pixels=10**10)
    # 20000² = 4e8 pixels: over twice PIL's MAX_IMAGE_PIXELS, so PIL refuses at open.
    with pytest.raises(RenderError) as ei:
        lax.render("b", prompt="<image>", images=[png_header_only(20000, 20000)])
    assert ei.value.rule == "render.image_too_large"
    assert "decompression bomb" in str(ei.value)


@pytest.mark.parametrize("blob", ["garbage", "truncated", "no_pixels", "bad_type"])
def test_unreadable_images(renderer: Renderer, blob: str, tmp_path) -> None:
    good = png_bytes(rand_image(64, 64, 9))
    src = {
        "garbage": b"this is not an image at all",
        "truncated": good[: len(good) // 2],
        "no_pixels": png_header_only(64, 64),
        "bad_type": 12345,
    }[blob]
    with pytest.raises(RenderError) as ei:
        renderer.render("c", prompt="<image>", images=[src])
    assert ei.value.rule == {
        "bad_type": "render.image_type",
        "garbage": "render.image_format",  # no accepted decoder recognises it
    }.get(blob, "render.image_unreadable")
    assert ei.value.item == 0


def test_path_input_and_extreme_aspect(renderer: Renderer, tmp_path: Path) -> None:
    p = tmp_path / "img.png"
    img = rand_image(70, 90, 10)
    img.save(p)
    assert renderer.render("p", prompt="<image>", images=[p]).features.mm_hashes == (
        renderer.render("p", prompt="<image>", images=[img]).features.mm_hashes
    )
    with pytest.raises(RenderError) as ei:
        renderer.render("p", prompt="<image>", images=[rand_image(2, 500)])
    assert ei.value.rule == "render.image_unprocessable"


async def test_render_async(renderer: Renderer) -> None:
    ev = await renderer.render_async("a", prompt="<image>!", images=[rand_image(56, 56)])
    assert ev.features.mm_placeholders["image"][0].length == 4


# ------------------------------------------------------------------ image formats and paths


def encoded(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


# A minimal EPS: PIL's EpsImagePlugin recognises it and would run Ghostscript to load it.
EPS = (
    b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 64\n"
    b"%%EndComments\nnewpath 0 0 moveto 64 64 lineto stroke\nshowpage\n%%EOF\n"
)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_accepted_formats_decode(renderer: Renderer, fmt: str) -> None:
    assert fmt in IMAGE_FORMATS
    img = rand_image(64, 80, 12)
    ev = renderer.render("f", prompt="<image>", images=[encoded(img, fmt)])
    assert ev.features.mm_placeholders["image"][0].length > 0


def test_gif_is_read_at_its_first_frame(renderer: Renderer) -> None:
    first, second = rand_image(64, 64, 13), rand_image(64, 64, 14)
    anim = encoded(first, "GIF", save_all=True, append_images=[second], duration=10)
    still = encoded(first, "GIF")
    one = renderer.render("g", prompt="<image>", images=[anim]).features.mm_hashes
    assert one == renderer.render("g", prompt="<image>", images=[still]).features.mm_hashes


@pytest.mark.parametrize("fmt", ["EPS", "TIFF", "ICO", "PPM", "TGA"])
def test_other_formats_are_refused_before_decoding(
    renderer: Renderer, fmt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from PIL import EpsImagePlugin

    # Had PIL reached the EPS plugin's loader, it would have tried to run Ghostscript.
    def no_ghostscript(*a: object, **k: object) -> None:
        raise AssertionError("Ghostscript reached")

    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", no_ghostscript)
    blob = EPS if fmt == "EPS" else encoded(rand_image(64, 64, 15), fmt)
    with pytest.raises(RenderError) as ei:
        renderer.render("x", prompt="<image>", images=[blob])
    assert (ei.value.rule, ei.value.modality, ei.value.item) == ("render.image_format", "image", 0)
    assert "PNG" in str(ei.value)
    # The same from a file, and from an image a caller opened lazily (not yet decoded).
    p = tmp_path / f"img.{fmt.lower()}"
    p.write_bytes(blob)
    with pytest.raises(RenderError) as ei:
        renderer.render("x", prompt="<image>", images=[p])
    assert ei.value.rule == "render.image_format"
    with pytest.raises(RenderError) as ei:
        renderer.render("x", prompt="<image>", images=[Image.open(p)])
    assert ei.value.rule == "render.image_format"


def test_a_str_image_is_not_a_path_unless_files_are_allowed(
    renderer: Renderer, tmp_path: Path
) -> None:
    p = tmp_path / "img.png"
    rand_image(64, 64, 16).save(p)
    for s in (str(p), "/etc/passwd", "aGVsbG8="):
        with pytest.raises(RenderError) as ei:
            renderer.render("s", prompt="<image>", images=[s])
        assert (ei.value.rule, ei.value.item) == ("render.image_type", 0)
        assert "not read as a file path" in str(ei.value)
    files = Renderer(renderer.info, max_image_pixels=10**6, allow_file_paths=True)
    assert files.render("s", prompt="<image>", images=[str(p)]).features.mm_hashes == (
        renderer.render("s", prompt="<image>", images=[p]).features.mm_hashes
    )
