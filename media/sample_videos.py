"""Deterministic synthetic videos for the demo, `epd verify` and tests: frames that move, and
those frames encoded in memory as MP4/WebM/MKV (PyAV) or as an animated GIF/WebP."""

from __future__ import annotations

import io
from fractions import Fraction
from typing import Any

import numpy as np
from PIL import Image

from media.sample_images import synthetic_image


def synthetic_frames(n: int, width: int, height: int, seed: int = 0) -> list[Image.Image]:
    """``n`` frames of one synthetic image sliding to the right (distinct frames, same size)."""
    base = np.asarray(synthetic_image(width * 2, height, seed=seed))
    step = max(1, width // max(n, 1))
    return [Image.fromarray(base[:, k * step : k * step + width].copy(), "RGB") for k in range(n)]


def encode_video(
    frames: list[Image.Image],
    fps: int = 10,
    container: str = "mp4",
    codec: str = "libx264",
    *,
    pts: list[int] | None = None,
    time_base: Fraction | None = None,
) -> bytes:
    """``frames`` encoded as a video file in memory. ``pts``/``time_base`` place frames at
    chosen times (e.g. two frames ten hours apart: a long video's header in a few bytes)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream: Any = out.add_stream(codec, rate=fps)
        stream.width, stream.height = frames[0].size
        stream.pix_fmt = "yuv420p"
        if time_base is not None:
            stream.time_base = time_base
        for k, img in enumerate(frames):
            frame = av.VideoFrame.from_image(img)
            if pts is not None:
                frame.pts, frame.time_base = pts[k], time_base
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def encode_animation(frames: list[Image.Image], fmt: str = "GIF", duration_ms: int = 100) -> bytes:
    """``frames`` as an animated GIF or WebP."""
    buf = io.BytesIO()
    frames[0].save(
        buf,
        format=fmt,
        save_all=True,
        append_images=frames[1:],
        duration=duration_ms,
        loop=0,
        **({"lossless": True} if fmt == "WEBP" else {}),
    )
    return buf.getvalue()


def synthetic_mp4(
    n: int = 12, width: int = 96, height: int = 64, fps: int = 6, seed: int = 0
) -> bytes:
    """A small H.264 MP4 of ``synthetic_frames`` (for the demo and verify)."""
    return encode_video(synthetic_frames(n, width, height, seed), fps=fps)
