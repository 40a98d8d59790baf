"""The API's ``videos`` field: data URLs of video files or lists of frame images; sizes before
base64 decoding (413), types by declared type and magic bytes (415); the parsed bytes render."""

from __future__ import annotations

import base64
import functools
import json
from typing import Any

import pytest

from frontend.api.errors import ApiError
from frontend.api.submit import native
from media.sample_images import png_bytes
from media.sample_videos import encode_animation, synthetic_frames, synthetic_mp4
from producers.render import Renderer
from runtime.model import load_render_info
from runtime.request_limits import RequestLimits
from runtime.settings import Settings


def limits_of(s: Settings) -> RequestLimits:
    """The request limits of ``s`` for the tiny model (its vocabulary and context)."""
    info = _tiny_info()
    return RequestLimits.from_settings(
        s, vocab_size=info.vocab_size, model_context=info.context_length
    )


@functools.cache
def _tiny_info() -> Any:
    from runtime.model import load_render_info

    return load_render_info("tiny")


def parse_json_submit(body: bytes, s: Settings) -> Any:
    """The JSON body parser with the request limits of ``s``."""
    return native.parse_json_submit(body, limits_of(s), s)


def url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def body(**kw: object) -> bytes:
    return json.dumps({"prompt": "<video>", **kw}).encode()


def test_file_and_frame_list_parse_and_render() -> None:
    s = Settings()
    mp4 = synthetic_mp4(8, 64, 64, fps=4)
    frames = [png_bytes(f) for f in synthetic_frames(4, 56, 56)]
    gif = encode_animation(synthetic_frames(4, 56, 56))
    inp = parse_json_submit(
        json.dumps(
            {
                "prompt": "<video> <video> <video>",
                "videos": [
                    url("video/mp4", mp4),
                    [url("image/png", f) for f in frames],
                    base64.b64encode(gif).decode(),
                ],
            }
        ).encode(),
        s,
    )
    assert inp.videos == [mp4, frames, gif]
    ev = Renderer(load_render_info("tiny"), max_image_pixels=1 << 24).render(
        "r", prompt=inp.request.prompt, videos=inp.videos
    )
    assert len(ev.features.mm_hashes["video"]) == 3
    # the fingerprint (Idempotency-Key) sees the videos
    other = parse_json_submit(body(videos=[url("video/mp4", synthetic_mp4(8, 64, 64, 4, 1))]), s)
    assert (
        other.fingerprint()
        != parse_json_submit(body(videos=[url("video/mp4", mp4)]), s).fingerprint()
    )


@pytest.mark.parametrize(
    ("videos", "status", "rule"),
    [
        (["data:video/avi;base64,AAAA"], 415, "video.type"),
        ([url("video/mp4", b"%PDF-1.7 not a video")], 415, "video.type"),
        (["/etc/passwd"], 400, "video.encoding"),
        ([url("video/mp4", b"\x00" * 3000)], 413, "video.size"),
        ([[url("image/png", b"\x00" * 10)]], 415, "video.type"),
        ([url("video/mp4", b"\x00\x00\x00\x18ftypmp42")] * 3, 413, "video.count"),
    ],
    ids=["avi", "pdf", "path", "size", "frame-type", "count"],
)
def test_bad_videos_are_refused_naming_the_rule(videos: list, status: int, rule: str) -> None:
    s = Settings(api_max_video_bytes=2048, api_max_videos=2)
    with pytest.raises(ApiError) as err:
        parse_json_submit(body(videos=videos), s)
    assert (err.value.status, err.value.rule) == (status, rule)


def test_frame_list_count_has_its_own_rule_and_message() -> None:
    s = Settings(video_max_source_frames=2)
    frame = url("image/png", png_bytes(synthetic_frames(1, 16, 16)[0]))
    with pytest.raises(ApiError) as err:
        parse_json_submit(body(videos=[[frame] * 3]), s)
    e = err.value
    assert (e.status, e.rule, e.item) == (413, "video.frames", 0)
    assert "3 frames" in e.message and "bytes" not in e.message


def test_video_and_image_strings_share_one_decoder() -> None:
    """A malformed data: URL is refused the same way in both fields, each naming its own."""
    parse = parse_json_submit

    s = Settings()
    for field, rule in (("images", "image.encoding"), ("videos", "video.encoding")):
        with pytest.raises(ApiError) as err:
            parse(json.dumps({"prompt": "x", field: ["data:image/png,abc"]}).encode(), s)
        assert (err.value.rule, err.value.field) == (rule, field)


@pytest.mark.parametrize(
    ("rule", "status"),
    [
        ("render.timeout", 503),
        ("render.video_too_long", 413),
        ("render.video_decode_budget", 413),
        ("render.video_too_large", 413),
        ("render.video_codec", 422),
    ],
)
def test_render_refusals_map_to_statuses(rule: str, status: int) -> None:
    from frontend.api.errors import from_validation
    from media.video import VideoError

    api = from_validation(VideoError(rule, "m", modality="video", item=1))
    assert (api.status, api.rule, api.item) == (status, rule, 1)
