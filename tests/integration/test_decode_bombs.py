"""Images that are small on the wire and slow to decode (issue 27, defect 1), through the HTTP
API on real services: a progressive JPEG whose last scan repeats thousands of times.

The structure walker refuses such a file before any decoder sees it (one API, default limits);
where the limit lets one through (a second API with the scan limit lifted and a short render
time), the decode runs in a process that the timeout kills, so a refused request costs nothing
afterwards, and text-only requests never wait behind image decodes."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from bench.api_decode_bombs import tree_cpu_s
from epd.local_pipeline import worker_env
from media.sample_images import repeated_scan_jpeg
from runtime.settings import Settings
from tests.integration.api_stack import ApiProcess, isolated, start_api

pytestmark = pytest.mark.integration

RENDER_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def apis(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ApiProcess]]:
    """``default``: the deployment's limits; ``lifted``: scans unbounded, 3 s renders, two
    render slots. No workers: every request here is refused or only needs to be accepted."""
    from runtime.kafka import ensure_topics
    from schemas.topics import Topics

    cfg = isolated(settings)
    asyncio.run(ensure_topics(cfg, Topics(cfg.topic_prefix).all()))
    env = worker_env(cfg)
    env.pop("EPD_API_TOKENS", None)
    env["EPD_READY_STAGES"] = ""  # no workers here: readiness must not wait for them
    log_dir = tmp_path_factory.mktemp("decode-bombs")
    started: dict[str, ApiProcess] = {}
    try:
        started["default"] = start_api(env, log_dir / "api-default.log")
        lifted = {
            "EPD_MAX_IMAGE_SCANS": "1000000",
            "EPD_MAX_IMAGE_CHUNKS": "1000000",
            "EPD_API_RENDER_TIMEOUT_S": str(RENDER_TIMEOUT_S),
            "EPD_API_RENDER_CONCURRENCY": "2",
        }
        started["lifted"] = start_api({**env, **lifted}, log_dir / "api-lifted.log")
        yield started
    finally:
        for api in started.values():
            api.stop()


@pytest.fixture
async def lifted(apis: dict[str, ApiProcess]) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=apis["lifted"].url, timeout=60) as c:
        yield c


def bomb_body(scans: int = 4000) -> dict[str, object]:
    """A 4096x4096 progressive JPEG of ``scans`` repeated scans (about 130 KB), as a native
    submission."""
    data = repeated_scan_jpeg(4096, scans)
    return {
        "prompt": "What is this? <image>",
        "images": [base64.b64encode(data).decode()],
        "max_tokens": 1,
    }


def cpu_seconds(api: ApiProcess) -> float:
    """CPU time of the API process and every process under it."""
    return tree_cpu_s(api.proc.pid)


async def test_a_jpeg_of_repeated_scans_is_refused_before_decoding(
    apis: dict[str, ApiProcess],
) -> None:
    data = repeated_scan_jpeg(4096, 4000)
    url = f"data:image/jpeg;base64,{base64.b64encode(data).decode()}"
    chat = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look"},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
    }
    async with httpx.AsyncClient(base_url=apis["default"].url, timeout=60) as http:
        t0 = time.monotonic()
        r = await http.post("/v1/requests", json=bomb_body())
        native_s = time.monotonic() - t0
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert (err["rule"], err["modality"], err["item"]) == (
            "render.image_too_complex",
            "image",
            0,
        ), err
        assert "EPD_MAX_IMAGE_SCANS" in err["message"]
        assert native_s < 5, native_s  # answered from the structure, not after a decode

        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == "render.image_too_complex", r.text
        assert err["param"] == "messages[0].content[1].image_url.url", err


async def test_a_decode_past_the_render_time_is_killed_and_costs_nothing_after(
    apis: dict[str, ApiProcess], lifted: httpx.AsyncClient
) -> None:
    api = apis["lifted"]
    t0 = time.monotonic()
    r = await lifted.post("/v1/requests", json=bomb_body())
    answered_s = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert r.json()["error"]["rule"] == "render.timeout", r.text
    assert answered_s < RENDER_TIMEOUT_S + 3, answered_s

    # The decode went with its process: the API is idle again at once (a thread would go on
    # decoding for many seconds more).
    await asyncio.sleep(0.5)
    before = cpu_seconds(api)
    await asyncio.sleep(4.0)
    burned = cpu_seconds(api) - before
    print(f"API CPU in the 4 s after the refusal: {burned:.3f} s")
    assert burned < 0.5, f"{burned:.2f} CPU-seconds in the 4 s after the refusal"


async def test_text_requests_do_not_wait_behind_image_decodes(
    lifted: httpx.AsyncClient,
) -> None:
    bombs = [asyncio.create_task(lifted.post("/v1/requests", json=bomb_body())) for _ in range(4)]
    await asyncio.sleep(0.5)  # both render slots busy decoding, two more bombs queued
    t0 = time.monotonic()
    r = await lifted.post("/v1/requests", json={"prompt": "Just text", "max_tokens": 1})
    text_s = time.monotonic() - t0
    assert r.status_code == 202, r.text
    answers = await asyncio.gather(*bombs)
    assert all(a.status_code == 503 for a in answers), [a.text for a in answers]
    # The bombs hold the slots for RENDER_TIMEOUT_S each; the text request needs none.
    assert text_s < RENDER_TIMEOUT_S / 2, f"a text-only request took {text_s:.2f} s"


def _encoded_variants() -> dict[str, bytes]:
    """Images whose decode has rules of its own: EXIF orientation, transparency, a palette,
    16-bit grayscale, progressive JPEG."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(3)
    rgb = Image.fromarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8))
    out: dict[str, bytes] = {}

    def save(name: str, img: Image.Image, fmt: str, **kw: object) -> None:
        buf = io.BytesIO()
        img.save(buf, fmt, **kw)
        out[name] = buf.getvalue()

    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: width and height swap once upright
    save("jpeg-exif-rotated", rgb, "JPEG", exif=exif)
    save("jpeg-progressive", rgb, "JPEG", progressive=True)
    save("png-rgba", rgb.convert("RGBA"), "PNG")
    save("gif-palette", rgb.convert("P"), "GIF")
    save("webp", rgb, "WEBP")
    save("bmp", rgb, "BMP")
    wide = (rng.integers(0, 65535, (32, 32)).astype(np.uint16)).astype("<u2")
    save("png-16bit-gray", Image.fromarray(wide), "PNG")
    return out


async def test_the_decode_processes_give_exactly_what_the_renderer_thread_gives() -> None:
    from media.image_decoder import ImageDecoder
    from media.image_loading import ImageLimits, load_image
    from schemas.errors import ValidationError

    limits = ImageLimits(64 * 64)
    decoder = ImageDecoder(limits, 1)
    try:
        for name, data in _encoded_variants().items():
            got = await decoder.decode(data, ValidationError)
            want = load_image(data, limits, ValidationError)
            assert (got.size, got.mode) == (want.size, want.mode), name
            assert got.tobytes() == want.tobytes(), name
        for data, rule in (
            (b"not an image", "render.image_format"),
            (_encoded_variants()["bmp"][:40], "render.image_unreadable"),
        ):
            with pytest.raises(ValidationError) as e:
                await decoder.decode(data, ValidationError)
            assert e.value.rule == rule
        big = repeated_scan_jpeg(128, 1)  # 128x128 = 16,384 pixels > 4,096
        with pytest.raises(ValidationError) as e:
            await decoder.decode(big, ValidationError)
        assert e.value.rule == "render.image_too_large"
        assert "EPD_MAX_IMAGE_PIXELS" in str(e.value)
        assert decoder.killed == 0  # refusals are answers, not crashes
    finally:
        await decoder.close()


async def test_a_decode_out_of_time_kills_its_process_and_the_next_image_decodes() -> None:
    from media.image_decoder import DecodeTimedOut, ImageDecoder
    from media.image_loading import ImageLimits
    from media.image_structure import StructureLimits
    from schemas.errors import ValidationError

    decoder = ImageDecoder(
        ImageLimits(4096 * 4096, StructureLimits(max_scans=10**7, max_chunks=10**7)), 1
    )
    try:
        await decoder.start()
        (child,) = decoder._idle
        with pytest.raises(DecodeTimedOut):
            await decoder.decode(
                repeated_scan_jpeg(4096, 4000), ValidationError, time.monotonic() + 0.5
            )
        assert decoder.killed == 1
        await asyncio.wait_for(child.proc.wait(), 5)  # the decode went with its process
        ok = await decoder.decode(repeated_scan_jpeg(64, 1), ValidationError)
        assert ok.size == (64, 64)
    finally:
        await decoder.close()
