"""Video inputs -> sampled RGB frames, with every limit checked before decoding.

Three kinds of input become one :class:`VideoPlan` (what will be kept and what decoding it
costs, from headers only) and then one :class:`VideoClip` (the sampled frames and their rate):

- a file's bytes (MP4/MOV, WebM/MKV) decoded with PyAV (FFmpeg), see :mod:`media.video_file`;
- an animated GIF or WebP (Pillow): size from the header, frame count and delays from the block
  headers (:mod:`media.animation_headers`), no frame decoded to learn them;
- a list of frames (PIL images, ``(H, W, 3)`` uint8 arrays or encoded images), optionally wrapped
  in :class:`VideoFrames` to give their rate.

Frames are sampled as the Qwen2-VL video processor samples them (``sample_frames`` with ``fps``):
``EPD_VIDEO_FPS`` frames per second, at least 4, at most ``EPD_VIDEO_MAX_FRAMES``, rounded down to
a multiple of the temporal patch size, spread evenly over the source frames.

Decoding work is bounded before it starts: the frames the decoder must produce to reach the
sampled ones, times their pixels, must stay within ``EPD_VIDEO_MAX_DECODE_PIXELS``
(``render.video_decode_budget``). Kept frames go through the image path's RGB and orientation
rules (:mod:`media.pictures`) and, when the caller gives a size, are resized as they are
decoded, so memory holds only resized frames.

All of this is CPU-bound and synchronous; the renderer runs it in a worker thread.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from media.animation_headers import HeaderError, gif_frame_delays, webp_durations
from media.image_structure import too_complex
from media.pictures import IMAGE_FORMATS, pil_errors, upright_rgb, upright_size
from media.video_file import plan_file
from media.video_plan import (
    ANIMATION_DECODE_COST,
    Size,
    VideoClip,
    VideoError,
    VideoFrames,
    VideoInput,
    VideoLimits,
    VideoPlan,
    check_budget,
    check_count,
    check_duration,
    check_size,
    check_time,
    finish,
    sample_indices,
    video_error,
)

if TYPE_CHECKING:
    pass

ANIMATION_FORMATS = ("GIF", "WEBP")
"""Pillow decoders for animated images given as a video."""


def _pil(index: int, unreadable: str = "render.video_unreadable") -> AbstractContextManager[None]:
    return pil_errors(
        lambda rule, msg: video_error(rule, msg, index),
        too_large="render.video_too_large",
        unreadable=unreadable,
        what="video frame",
    )


# ---------------------------------------------------------------------------------------------
# frame lists


FRAME_FORMATS = IMAGE_FORMATS
"""PIL decoders a frame given as encoded bytes may reach (its first frame is used)."""


def _frame_errors(k: int, index: int) -> AbstractContextManager[None]:
    """Pillow failures on frame ``k``: a header claiming a decompression bomb is too_large,
    anything else names the frame (``render.video_frames``)."""

    def make(rule: str, msg: str) -> VideoError:
        return video_error(rule, f"frame {k}: {msg}", index)

    return pil_errors(
        make, too_large="render.video_too_large", unreadable="render.video_frames", what="frame"
    )


def _open_frames(frames: list[Any], limits: VideoLimits, index: int) -> list[Any]:
    """Frames given as encoded image bytes, opened lazily: structure counted and header read,
    pixels not decoded, so what each frame costs is checked before any frame decodes."""
    out = []
    for k, f in enumerate(frames):
        if isinstance(f, bytes | bytearray | memoryview):
            why = too_complex(f, limits.structure)
            if why is not None:
                raise video_error("render.video_too_complex", f"frame {k}: {why}", index)
            with _frame_errors(k, index):
                f = Image.open(io.BytesIO(bytes(f)), formats=FRAME_FORMATS)
        out.append(f)
    return out


def _frame_image(f: Any, k: int, index: int) -> Image.Image:
    if isinstance(f, Image.Image):
        with _frame_errors(k, index):
            f.load()
            return upright_rgb(f)
    if isinstance(f, np.ndarray):
        if f.dtype != np.uint8 or f.ndim != 3 or f.shape[2] != 3:
            raise video_error(
                "render.video_frames",
                f"frame {k}: arrays must be (H, W, 3) uint8, got {f.shape} {f.dtype}",
                index,
            )
        return Image.fromarray(f, "RGB")
    raise video_error(
        "render.video_frames",
        f"frame {k}: unsupported frame type {type(f).__name__} (PIL image or uint8 array)",
        index,
    )


def _frame_size(f: Any) -> tuple[int, int]:
    if isinstance(f, Image.Image):
        return upright_size(f)
    if isinstance(f, np.ndarray) and f.ndim >= 2:
        return int(f.shape[1]), int(f.shape[0])
    return (0, 0)


def plan_frames(src: VideoFrames, limits: VideoLimits, index: int = 0) -> VideoPlan:
    """Sample a caller's frame list; every frame must have the first frame's (upright) size."""
    frames = _open_frames(list(src.frames), limits, index)
    if not frames:
        raise video_error("render.video_empty", "the frame list is empty", index)
    check_count(len(frames), limits, index)
    w, h = _frame_size(frames[0])
    check_size(w, h, limits, index)
    for k, f in enumerate(frames):
        if _frame_size(f) != (w, h):
            raise video_error(
                "render.video_frames",
                f"frame {k} is {'x'.join(map(str, _frame_size(f)))}, frame 0 is {w}x{h}; all "
                "frames of a video must have one size",
                index,
            )
    fps = float(src.fps) if src.fps is not None else limits.fps
    if not math.isfinite(fps) or fps <= 0:
        raise video_error("render.video_fps", f"frame rate must be positive, got {src.fps}", index)
    check_duration(len(frames) / fps, limits, index)
    keep = sample_indices(len(frames), fps, limits)
    check_budget(len(keep), w, h, limits, index)

    def decode(size: Size | None, give_up_at: float | None) -> list[Image.Image]:
        out = []
        for i in keep:
            check_time(give_up_at, index)
            out.append(finish(_frame_image(frames[i], i, index), size))
        return out

    return VideoPlan("frames", w, h, len(frames), keep, fps, len(keep), decode)


# ---------------------------------------------------------------------------------------------
# animated GIF / WebP


def is_animation(data: bytes) -> bool:
    """GIF or WebP by magic bytes (the only image formats accepted as a video)."""
    return data[:6] in (b"GIF87a", b"GIF89a") or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


def _durations_ms(img: Image.Image, data: bytes, index: int) -> list[float]:
    """Each frame's delay from the block headers; Pillow would composite every frame to tell."""
    if img.format == "GIF":
        try:
            raw: list[float] = [float(d) for d in gif_frame_delays(data)]
        except HeaderError as e:
            raise video_error(
                "render.video_unreadable", f"cannot read the GIF: {e}", index
            ) from None
        if not raw:
            raise video_error("render.video_empty", "the GIF holds no frames", index)
    else:
        total = int(getattr(img, "n_frames", 1))
        raw = [float(d) for d in webp_durations(data)][:total]
        raw += [0.0] * (total - len(raw))
    # Browsers show a 0 ms frame for 100 ms; use that rate too.
    return [d or 100.0 for d in raw]


def plan_animation(data: bytes, limits: VideoLimits, index: int = 0) -> VideoPlan:
    """Plan an animated GIF/WebP: size, frame count, duration and decoding cost from headers.
    Reaching frame k means compositing every frame before it, so the cost is up to the last
    kept frame."""
    with _pil(index):
        img = Image.open(io.BytesIO(data), formats=ANIMATION_FORMATS)
        w, h = upright_size(img)
    check_size(w, h, limits, index)
    durations = _durations_ms(img, data, index)
    total = len(durations)
    check_count(total, limits, index)
    seconds = sum(durations) / 1000.0
    check_duration(seconds, limits, index)
    native = total / seconds if seconds > 0 else limits.fps
    keep = sample_indices(total, native, limits)
    check_budget(max(keep) + 1, w, h, limits, index, ANIMATION_DECODE_COST)

    def decode(size: Size | None, give_up_at: float | None) -> list[Image.Image]:
        frames = []
        with _pil(index):
            for k in keep:
                check_time(give_up_at, index)
                img.seek(k)
                frames.append(finish(upright_rgb(img), size))
        return frames

    return VideoPlan("animation", w, h, total, keep, native, max(keep) + 1, decode)


# ---------------------------------------------------------------------------------------------
# dispatch


def plan_video(
    src: VideoInput, limits: VideoLimits, index: int = 0, *, max_bytes: int | None = None
) -> VideoPlan:
    """Any accepted video input -> its plan (headers read, limits and decode budget checked,
    nothing kept decoded). Raises ``VideoError`` naming rule and item."""
    if isinstance(src, VideoFrames):
        return plan_frames(src, limits, index)
    if isinstance(src, Sequence) and not isinstance(src, str | bytes | bytearray | memoryview):
        return plan_frames(VideoFrames(src), limits, index)
    if isinstance(src, Path):
        try:
            src = src.read_bytes()
        except OSError as e:
            raise video_error(
                "render.video_unreadable", f"cannot read the file: {e}", index
            ) from None
    if not isinstance(src, bytes | bytearray | memoryview):
        raise video_error(
            "render.video_type",
            f"unsupported video input type {type(src).__name__} (file bytes, a pathlib.Path, "
            "VideoFrames or a list of frames)",
            index,
        )
    data = bytes(src)
    if max_bytes is not None and len(data) > max_bytes:
        raise video_error(
            "render.video_too_large",
            f"video file is {len(data)} bytes; the limit is {max_bytes}",
            index,
        )
    if not data:
        raise video_error("render.video_empty", "the video file is empty", index)
    if is_animation(data):
        return plan_animation(data, limits, index)
    return plan_file(data, limits, index)


def load_video(
    src: VideoInput, limits: VideoLimits, index: int = 0, *, max_bytes: int | None = None
) -> VideoClip:
    """Any accepted video input -> sampled frames at their own size."""
    return plan_video(src, limits, index, max_bytes=max_bytes).clip()
