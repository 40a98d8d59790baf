"""Real-world image inputs: derived limits, EXIF orientation, mode conversion, bf16 transport.

The public Qwen2-VL processor config (``max_pixels`` 12,845,056, patch 14, merge 2, temporal 2)
is built here from its published values; the tiny model's processor keeps images small.
"""

from __future__ import annotations

import io
import struct
import uuid

import blake3
import numpy as np
import pytest
import torch
from PIL import Image
from pydantic import SecretStr
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from gpu_workers.compute import encode_items
from producers.fanout import FanOut
from producers.render import Renderer, to_rgb
from producers.render_errors import RenderError
from runtime.model import ModelBundle, RenderInfo, load_model, load_render_info
from runtime.processor_limits import input_limits, pixel_dtype
from runtime.settings import Settings
from runtime.stores.local import LocalStore
from schemas.codec import decode, encode
from schemas.types import EncodeEvent, TensorRef

PUBLIC_MAX_PIXELS = 12_845_056


def public_processor() -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's published preprocessor config (Qwen/Qwen2-VL-7B-Instruct)."""
    return Qwen2VLImageProcessorPil(
        min_pixels=3136,
        max_pixels=PUBLIC_MAX_PIXELS,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )


@pytest.fixture(scope="module")
def info() -> RenderInfo:
    return load_render_info("tiny")


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return load_model("tiny", device="cpu")


@pytest.fixture(scope="module")
def renderer(info: RenderInfo) -> Renderer:
    return Renderer.for_settings(info, Settings())


def pv_of(renderer: Renderer, img: object) -> torch.Tensor:
    ev = renderer.render("r", prompt="<image>", images=[img])
    return ev.features.kwargs_data["image"][0]["pixel_values"]


# ------------------------------------------------------------------ derived limits


def test_limits_follow_the_public_processor_config() -> None:
    limits = input_limits(Settings(), public_processor())
    assert limits.max_pixels == PUBLIC_MAX_PIXELS
    # max_pixels x 3 channels x temporal patch 2 x 4 bytes (fp32)
    assert limits.max_tensor_bytes == PUBLIC_MAX_PIXELS * 24 > 256 * 1024 * 1024
    assert limits.max_image_pixels == 4 * PUBLIC_MAX_PIXELS
    # A 4032x3024 photo, and a 48 MP one, fit; explicit settings still override.
    assert 4032 * 3024 <= 8064 * 6048 <= limits.max_image_pixels
    explicit = input_limits(
        Settings(max_tensor_bytes=1000, max_image_pixels=2000), public_processor()
    )
    assert (explicit.max_tensor_bytes, explicit.max_image_pixels) == (1000, 2000)


@pytest.mark.parametrize(
    "size", [(4032, 3024), (3024, 4032), (8064, 6048), (12000, 60), (3584, 3584), (100, 100)]
)
def test_any_image_the_processor_accepts_fits_the_tensor_limit(size: tuple[int, int]) -> None:
    proc = public_processor()
    limit = input_limits(Settings(), proc).max_tensor_bytes
    w, h = size
    rh, rw = smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=PUBLIC_MAX_PIXELS)
    rows = (rh // 14) * (rw // 14)
    assert rows * 3 * 2 * 14 * 14 * 4 <= limit


def test_tiny_processor_keeps_the_floors(info: RenderInfo) -> None:
    limits = input_limits(Settings(), info.image_processor)
    assert limits.max_tensor_bytes == 256 * 1024 * 1024
    assert limits.max_image_pixels == 4096 * 4096


def jpeg_header_only(width: int, height: int) -> bytes:
    """A real JPEG's header with its frame size rewritten and its scan data cut off: opening it
    reads the size; decoding it would fail (unreadable), so a refusal by size proves the size was
    checked before any pixel was decoded."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 10, 10)).save(buf, "JPEG")
    data = bytearray(buf.getvalue())
    sof = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, sof + 5, height, width)
    sos = data.index(b"\xff\xda")
    return bytes(data[: sos + 20])


def test_a_photo_above_the_derived_limit_is_refused_before_decoding(info: RenderInfo) -> None:
    public = RenderInfo(
        **{**{k: getattr(info, k) for k in info.__slots__}, "image_processor": public_processor()}
    )
    renderer = Renderer.for_settings(public, Settings())
    with pytest.raises(RenderError) as e:
        renderer.load_image(jpeg_header_only(9000, 6000), 3)
    assert e.value.rule == "render.image_too_large" and e.value.item == 3
    assert "54000000 pixels; the limit is 51380224" in str(e.value)
    # The same truncated file at an accepted size gets as far as decoding, and fails there.
    with pytest.raises(RenderError) as e:
        renderer.load_image(jpeg_header_only(4032, 3024), 0)
    assert e.value.rule == "render.image_unreadable"


# ------------------------------------------------------------------ EXIF and modes


@pytest.mark.parametrize(
    ("orientation", "transpose"), [(6, Image.Transpose.ROTATE_270), (3, Image.Transpose.ROTATE_180)]
)
def test_exif_orientation_is_applied(renderer: Renderer, orientation: int, transpose: int) -> None:
    rng = np.random.default_rng(orientation)
    stored = Image.fromarray(rng.integers(0, 255, (56, 112, 3), dtype=np.uint8))  # 112 wide
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    stored.save(buf, "PNG", exif=exif)
    upright = stored.transpose(Image.Transpose(transpose))
    got = renderer.render("r", prompt="<image>", images=[buf.getvalue()])
    want = renderer.render("r", prompt="<image>", images=[upright])
    grid = got.features.kwargs_data["image"][0]["image_grid_thw"].tolist()
    assert grid == want.features.kwargs_data["image"][0]["image_grid_thw"].tolist()
    if orientation == 6:
        assert grid == [1, 8, 4]  # portrait: 56 wide, 112 high
    assert torch.equal(pv_of(renderer, buf.getvalue()), pv_of(renderer, upright))
    assert not torch.equal(pv_of(renderer, buf.getvalue()), pv_of(renderer, stored))


def _modes() -> dict[str, Image.Image]:
    rng = np.random.default_rng(5)
    rgba = Image.fromarray(rng.integers(0, 255, (60, 90, 4), dtype=np.uint8), "RGBA")
    p_trans = rgba.convert("RGB").quantize(16)
    p_trans.info["transparency"] = 3
    return {
        "RGBA": rgba,
        "LA": rgba.convert("LA"),
        "P+transparency": p_trans,
        "P": rgba.convert("RGB").quantize(16),
        "L": rgba.convert("L"),
        "1": rgba.convert("1"),
        "CMYK": rgba.convert("RGB").convert("CMYK"),
        "RGB+tRNS": _with_info(rgba.convert("RGB"), transparency=(10, 20, 30)),
    }


def _with_info(img: Image.Image, **info: object) -> Image.Image:
    img.info.update(info)
    return img


@pytest.mark.parametrize("mode", list(_modes()))
def test_modes_convert_as_the_hf_processor_does(renderer: Renderer, mode: str) -> None:
    img = _modes()[mode]
    hf = renderer.info.image_processor(images=[img], return_tensors="pt")["pixel_values"]
    assert torch.equal(pv_of(renderer, img), hf)
    if mode in ("RGBA", "LA", "P+transparency"):
        # Transparency is composited onto white, not dropped.
        dropped = Image.fromarray(np.asarray(img.convert("RGB")))
        assert not torch.equal(hf, pv_of(renderer, dropped))


def test_mode_conversion_survives_the_file_round_trip(renderer: Renderer) -> None:
    img = _modes()["RGBA"]
    buf = io.BytesIO()
    img.save(buf, "PNG")
    assert torch.equal(pv_of(renderer, buf.getvalue()), pv_of(renderer, img))


def test_sixteen_bit_grayscale_keeps_its_top_eight_bits(renderer: Renderer) -> None:
    rng = np.random.default_rng(9)
    eight = rng.integers(0, 256, (56, 56), dtype=np.uint16)
    wide = Image.fromarray((eight << 8) | 0x7F)
    assert wide.mode == "I;16"
    buf = io.BytesIO()
    wide.save(buf, "PNG")
    ref = Image.fromarray(eight.astype(np.uint8), "L")
    assert np.array_equal(np.asarray(to_rgb(wide)), np.asarray(ref.convert("RGB")))
    assert torch.equal(pv_of(renderer, buf.getvalue()), pv_of(renderer, ref))


# ------------------------------------------------------------------ bf16 transport


def test_pixel_dtype_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pixel_dtype(Settings(pixel_dtype="bf16")) == torch.bfloat16
    assert pixel_dtype(Settings(pixel_dtype="fp32", device="cuda")) == torch.float32
    assert pixel_dtype(Settings(device="cpu")) == torch.float32
    auto = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert pixel_dtype(Settings(device="auto")) == auto  # this process's own device
    # CUDA workers named by the deployment: bf16 even from a fan-out without a GPU
    assert pixel_dtype(Settings(device="cuda")) == torch.bfloat16
    assert pixel_dtype(Settings(device="cuda:1")) == torch.bfloat16
    monkeypatch.setattr(
        "runtime.processor_limits.resolve_device", lambda spec: torch.device("cuda")
    )
    assert pixel_dtype(Settings()) == torch.bfloat16


def _fanout_settings(dtype: str, inline: int) -> Settings:
    return Settings(
        ec_secret=SecretStr("image-inputs-secret"),
        pixel_dtype=dtype,
        inline_limit_bytes=inline,
        ec_namespace=f"ec-{uuid.uuid4().hex[:8]}",
    )


@pytest.mark.parametrize("inline", [64 * 1024, 4 * 1024 * 1024])
async def test_bf16_transport_halves_pixel_bytes_and_round_trips(
    renderer: Renderer, info: RenderInfo, inline: int
) -> None:
    rng = np.random.default_rng(1)
    img = Image.fromarray(rng.integers(0, 255, (112, 140, 3), dtype=np.uint8))
    ev = renderer.render("req", prompt="see <image>", images=[img])
    pv = ev.features.kwargs_data["image"][0]["pixel_values"]
    sizes: dict[str, tuple[int, int]] = {}
    for dtype in ("fp32", "bf16"):
        store = LocalStore(f"local://img-{uuid.uuid4().hex[:8]}")
        plan = await FanOut(_fanout_settings(dtype, inline), store, info).plan(ev)
        (enc,) = plan.encode
        wire = decode(encode(enc), EncodeEvent)
        sent = wire.data["pixel_values"]
        if isinstance(sent, TensorRef):
            raw = await store.get_bytes(sent.key)
            assert sent.digest == blake3.blake3(raw).hexdigest()  # what the encoder checks
            got = torch.frombuffer(raw, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
            got = got.view(sent.shape)
        else:
            got = sent
        want = pv if dtype == "fp32" else pv.to(torch.bfloat16)
        assert got.dtype == want.dtype and torch.equal(got, want)  # bit exact through the wire
        sizes[dtype] = (len(encode(enc)), plan.claim_bytes)
        # The store key names the processor's output, whatever the transport.
        assert enc.ec_transfer.key.endswith(ev.features.mm_hashes["image"][0])
    if inline < pv.numel() * 4:  # claim-checked: the store holds half the bytes
        assert sizes["bf16"][1] * 2 == sizes["fp32"][1] == pv.numel() * 4
    else:  # inline: the encode event itself shrinks by the pixel bytes' half
        assert sizes["fp32"][0] - sizes["bf16"][0] == pv.numel() * 2


def test_the_encoder_takes_bf16_pixels_and_casts_them_to_its_dtype(
    bundle: ModelBundle, renderer: Renderer
) -> None:
    ev = renderer.render("r", prompt="<image>", images=[Image.new("RGB", (84, 56), (9, 99, 199))])
    item = ev.features.kwargs_data["image"][0]
    pv, grid = item["pixel_values"], item["image_grid_thw"]
    (from_bf16,) = encode_items(bundle, [(pv.to(torch.bfloat16), grid)])
    (from_fp32,) = encode_items(bundle, [(pv.to(torch.bfloat16).float(), grid)])
    assert from_bf16["embeds"].dtype == bundle.dtype == torch.float32
    assert torch.equal(from_bf16["embeds"], from_fp32["embeds"])
