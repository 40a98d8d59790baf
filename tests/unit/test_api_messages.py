"""Errors point at their real cause (issue 21, defect 12): a NaN is not "must be <= 2", URL-safe
or unpadded base64 is not "a file path", a chat-template image block beside ``<image>`` is
named, a huge PNG names our pixel limit (not Pillow's), BMP is accepted everywhere it is
listed, and a check that timed out says so."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image
from pydantic import ValidationError as PydanticValidationError

from frontend.api.errors import ApiError
from frontend.api.protocol import SubmitRequest
from frontend.api.routes.ops import failure
from frontend.api.submit.json_text import parse_json
from frontend.api.submit.media import IMAGE_TYPES, decode_image_string, sniff_image_type
from media.pictures import IMAGE_FORMATS
from media.sample_images import png_bytes, synthetic_image
from producers.prompt_tokens import QWEN_IMAGE_BLOCK
from producers.render import Renderer
from runtime.model import load_render_info
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from schemas.errors import ValidationError
from tests.unit.test_render import png_header_only

PNG = png_bytes(synthetic_image(28, 28, seed=3))


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    return Renderer.for_settings(load_render_info("tiny"), Settings())


def limits() -> RequestLimits:
    return RequestLimits.from_settings(Settings(), vocab_size=300, model_context=1024)


@pytest.mark.parametrize("field", ["temperature", "deadline_s", "max_tokens"])
@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_named_not_compared(field: str, constant: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_json(f'{{"prompt": "x", "{field}": {constant}}}', 32)
    assert (e.value.status, e.value.rule) == (400, "body.json")
    assert constant in e.value.message and "<=" not in e.value.message


def test_a_nan_that_got_past_json_is_not_a_finite_number() -> None:
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValidationError) as e:
            limits().check_sampling(16, value)
        assert e.value.rule == "sampling.temperature" and "finite" in e.value.detail
        with pytest.raises(ValidationError) as e:
            limits().check_deadline(value)
        assert "finite" in e.value.detail
    # a multipart form sends text: "nan" is refused by type, not by a bound
    with pytest.raises(PydanticValidationError) as pe:
        SubmitRequest.model_validate({"prompt": "x", "temperature": "nan"})
    assert "finite" in str(pe.value)


def test_base64_mistakes_are_named() -> None:
    std = base64.b64encode(PNG + b"\xfb\xff").decode()  # has '+' or '/' somewhere
    urlsafe = base64.urlsafe_b64encode(PNG + b"\xfb\xff").decode()
    assert urlsafe != std
    cases = {
        urlsafe: "URL-safe base64",
        std.rstrip("=") + ("" if len(std.rstrip("=")) % 4 else "A"): "padding",
        "/etc/passwd": "file path or URL",
        "https://example.com/cat.png": "file path or URL",
        "not base64!": "character '!' at position 10",
    }
    for text, words in cases.items():
        with pytest.raises(ApiError) as e:
            decode_image_string(text, 2, 1 << 20)
        assert (e.value.status, e.value.rule, e.value.item) == (400, "image.encoding", 2)
        assert words in e.value.message, (text[:20], e.value.message)
    assert decode_image_string(std, 0, 1 << 20) == PNG + b"\xfb\xff"


def test_a_template_block_beside_a_marker_is_named(renderer: Renderer) -> None:
    with pytest.raises(ValidationError) as e:
        renderer.render("r", prompt=f"{QWEN_IMAGE_BLOCK} and <image>", images=[PNG])
    assert e.value.rule == "render.marker_count"
    assert QWEN_IMAGE_BLOCK in e.value.detail and "1 '<image>'" in e.value.detail
    assert "2 images" in e.value.detail and "1 image was given" in e.value.detail


def test_a_huge_png_names_our_limit_not_pillows(renderer: Renderer) -> None:
    with pytest.raises(ValidationError) as e:
        renderer.render("r", prompt="<image>", images=[png_header_only(30000, 30000)])
    assert e.value.rule == "render.image_too_large"
    assert "900000000 pixels" in e.value.detail
    assert f"the limit is {renderer.max_image_pixels} pixels (EPD_MAX_IMAGE_PIXELS)" in str(e.value)
    assert str(2 * (Image.MAX_IMAGE_PIXELS or 0)) not in e.value.detail  # Pillow's own number


def test_bmp_is_accepted_wherever_formats_are_listed(renderer: Renderer) -> None:
    buf = io.BytesIO()
    synthetic_image(28, 28, seed=4).save(buf, format="BMP")
    bmp = buf.getvalue()
    assert sniff_image_type(bmp) == "image/bmp"
    assert sniff_image_type(b"BM" + b"\x00" * 40) is None  # "BM" alone is not a BMP
    # the API's types, the renderer's decoders (and the README's list) are one set
    assert {t.removeprefix("image/").upper() for t in IMAGE_TYPES} == {
        "WEBP" if f == "WEBP" else f for f in IMAGE_FORMATS
    }
    ev = renderer.render("r", prompt="<image>", images=[bmp])
    assert ev.features.mm_hashes["image"]
    url = f"data:image/bmp;base64,{base64.b64encode(bmp).decode()}"
    assert decode_image_string(url, 0, 1 << 20) == bmp


def test_a_check_that_timed_out_says_so() -> None:
    assert failure(TimeoutError(), 2.0) == "error: no answer within 2 s"
    assert failure(ConnectionError("refused"), 2.0) == "error: ConnectionError: refused"
    assert json.dumps(failure(OSError(), 2.0)) == '"error: OSError"'
