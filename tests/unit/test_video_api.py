"""The API's ``videos`` field: data URLs of video files or lists of frame images; sizes before
base64 decoding (413), types by declared type and magic bytes (415); the parsed bytes render."""

from __future__ import annotations

import base64
import json

import pytest

from producers.api.errors import ApiError
from producers.api.intake import parse_json_submit
from producers.render import Renderer
from producers.sample_images import png_bytes
from producers.sample_videos import encode_animation, synthetic_frames, synthetic_mp4
from runtime.model import load_render_info
from runtime.settings import Settings


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
        "r", prompt=inp.prompt, videos=inp.videos
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
