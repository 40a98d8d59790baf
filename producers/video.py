"""Video inputs -> sampled RGB frames, with every limit checked before decoding.

Three kinds of input become one :class:`VideoPlan` (what will be kept and what decoding it
costs, from headers only) and then one :class:`VideoClip` (the sampled frames and their rate):

- a file's bytes (MP4/MOV, WebM/MKV) decoded with PyAV (FFmpeg), see :mod:`producers.video_file`;
- an animated GIF or WebP (Pillow): size from the header, frame count and delays from the block
  headers (:mod:`producers.animation_headers`), no frame decoded to learn them;
- a list of frames (PIL images, ``(H, W, 3)`` uint8 arrays or encoded images), optionally wrapped
  in :class:`VideoFrames` to give their rate.

Frames are sampled as the Qwen2-VL video processor samples them (``sample_frames`` with ``fps``):
``EPD_VIDEO_FPS`` frames per second, at least 4, at most ``EPD_VIDEO_MAX_FRAMES``, rounded down to
a multiple of the temporal patch size, spread evenly over the source frames.

Decoding work is bounded before it starts: the frames the decoder must produce to reach the
sampled ones, times their pixels, must stay within ``EPD_VIDEO_MAX_DECODE_PIXELS``
(``render.video_decode_budget``). Kept frames go through the image path's RGB and orientation
rules (:mod:`producers.pictures`) and, when the caller gives a size, are resized as they are
decoded, so memory holds only resized frames.

All of this is CPU-bound and synchronous; the renderer runs it in a worker thread.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from producers.animation_headers import HeaderError, gif_frame_delays, webp_durations
from producers.pictures import IMAGE_FORMATS, pil_errors, upright_rgb, upright_size
from schemas.errors import ValidationError

if TYPE_CHECKING:
    from runtime.settings import Settings

ANIMATION_FORMATS = ("GIF", "WEBP")
"""Pillow decoders for animated images given as a video."""
MIN_FRAMES = 4
"""The Qwen2-VL video processor's ``min_frames``: short clips still get this many frames."""
ANIMATION_DECODE_COST = 16
"""Weight of one GIF/WebP pixel against one FFmpeg-decoded pixel in the decode budget. Measured
here: Pillow seeks through GIF frames at ~70 Mpx/s and animated WebP at ~33 Mpx/s, FFmpeg decodes
H.264 at ~1 Gpx/s."""
DEFAULT_MAX_DECODE_PIXELS = 4_000_000_000
"""About 2,000 decoded 1080p frames: a few seconds of FFmpeg time per video on one core."""


class VideoError(ValidationError):
    """A video the renderer cannot use; names the rule and the item."""


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """What a video may cost; every field is checked before frames are decoded."""

    fps: float = 2.0
    """Frames sampled per second of video (``EPD_VIDEO_FPS``)."""
    max_frames: int = 64
    """Frames kept per video after sampling (``EPD_VIDEO_MAX_FRAMES``)."""
    max_duration_s: float = 600.0
    """Longest video, by its header and by the decoded timestamps."""
    max_source_frames: int = 36_000
    """Frames the decoder may read (10 minutes at 60 fps)."""
    max_frame_pixels: int = 3840 * 2160
    """width * height of one source frame."""
    temporal_patch_size: int = 2
    """Sampled counts are rounded down to a multiple of this (the model's temporal patch)."""
    max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS
    """Frames decoded x their pixels (GIF/WebP weighted by ``ANIMATION_DECODE_COST``)."""

    @classmethod
    def from_settings(cls, settings: Settings, temporal_patch_size: int = 2) -> VideoLimits:
        """The limits ``EPD_VIDEO_*`` settings give."""
        return cls(
            fps=settings.video_fps,
            max_frames=settings.video_max_frames,
            max_duration_s=settings.video_max_duration_s,
            max_source_frames=settings.video_max_source_frames,
            max_frame_pixels=settings.video_max_frame_pixels,
            temporal_patch_size=temporal_patch_size,
            max_decode_pixels=settings.video_max_decode_pixels,
        )


@dataclass(frozen=True, slots=True)
class VideoFrames:
    """Frames a caller already has, with the rate they were taken at (None: ``EPD_VIDEO_FPS``,
    i.e. already sampled)."""

    frames: Sequence[Any]
    """PIL images, ``(H, W, 3)`` uint8 arrays or encoded frame images (bytes)."""
    fps: float | None = None


@dataclass(frozen=True, slots=True)
class VideoClip:
    """Sampled frames of one video, all RGB and of one size."""

    frames: list[Image.Image]
    fps: float
    """The rate of the *sampled* frames (the processor's ``sampled_fps``)."""
    source_frames: int
    source: str
    """``file``, ``animation`` or ``frames``."""


Size = tuple[int, int]
"""``(width, height)`` kept frames are resized to as they are decoded (None: as they are)."""
Decoder = Callable[[Size | None, float | None], list[Image.Image]]


@dataclass(frozen=True, slots=True)
class VideoPlan:
    """What one video will give and cost, known from headers before any kept frame decodes."""

    source: str
    width: int
    """Upright frame width (after EXIF orientation or a stream's display rotation)."""
    height: int
    total: int
    """Source frames."""
    keep: list[int]
    """Indices of the sampled frames."""
    native_fps: float
    decode_frames: int
    """Frames the decoder must produce to reach the kept ones."""
    decoder: Decoder
    close: Callable[[], None] = field(default=lambda: None)

    @property
    def fps(self) -> float:
        """The rate of the sampled frames."""
        return len(self.keep) / self.total * self.native_fps

    def clip(self, size: Size | None = None, give_up_at: float | None = None) -> VideoClip:
        """Decode the kept frames (resized to ``size`` as they come); ``give_up_at``: a
        ``time.monotonic()`` past which decoding stops with ``render.timeout``."""
        try:
            frames = self.decoder(size, give_up_at)
        finally:
            self.close()
        return VideoClip(frames, self.fps, self.total, self.source)


VideoInput = bytes | bytearray | memoryview | Path | VideoFrames | Sequence[Any]


def _err(rule: str, msg: str, index: int) -> VideoError:
    return VideoError(rule, msg, modality="video", item=index)


def sample_indices(total: int, native_fps: float, limits: VideoLimits) -> list[int]:
    """Indices of the frames to keep out of ``total`` taken at ``native_fps``.

    The Qwen2-VL video processor's rule (``sample_frames`` with ``fps``): ``total / native_fps *
    fps`` frames, at least ``MIN_FRAMES``, at most ``max_frames`` and ``total``, rounded down to a
    multiple of the temporal patch, spread as ``arange(0, total, total / n)``. A clip too short
    for one temporal patch keeps all its frames (the processor pads by repeating the last).
    """
    tps = limits.temporal_patch_size
    cap = math.floor(min(limits.max_frames, total) / tps) * tps
    want = total / native_fps * limits.fps if native_fps > 0 else float(total)
    n = math.floor(min(max(want, MIN_FRAMES), cap, total) / tps) * tps
    if n <= 0:
        return list(range(min(total, limits.max_frames)))
    # arange(0, total, total / n) truncated, in exact integer arithmetic.
    return [i * total // n for i in range(n)]


def check_size(w: int, h: int, limits: VideoLimits, index: int) -> None:
    """``render.video_too_large`` for a frame over ``max_frame_pixels``."""
    if w <= 0 or h <= 0 or w * h > limits.max_frame_pixels:
        raise _err(
            "render.video_too_large",
            f"video frames are {w}x{h} = {w * h} pixels; the limit is {limits.max_frame_pixels}",
            index,
        )


def check_duration(seconds: float, limits: VideoLimits, index: int) -> None:
    """``render.video_too_long`` past ``max_duration_s``."""
    if seconds > limits.max_duration_s:
        raise _err(
            "render.video_too_long",
            f"video lasts {seconds:.1f} s; the limit is {limits.max_duration_s:g} s",
            index,
        )


def check_count(frames: int, limits: VideoLimits, index: int) -> None:
    """``render.video_too_many_frames`` past ``max_source_frames``."""
    if frames > limits.max_source_frames:
        raise _err(
            "render.video_too_many_frames",
            f"video has {frames} frames; the limit is {limits.max_source_frames}",
            index,
        )


def check_budget(
    frames: int, w: int, h: int, limits: VideoLimits, index: int, weight: int = 1
) -> None:
    """``render.video_decode_budget`` when reaching the kept frames means decoding more than
    ``max_decode_pixels`` (weighted) pixels."""
    cost = frames * w * h * weight
    if cost > limits.max_decode_pixels:
        how = f" x {weight} (GIF/WebP decoding cost)" if weight != 1 else ""
        raise _err(
            "render.video_decode_budget",
            f"reaching the sampled frames means decoding {frames} frames of {w}x{h}{how} = "
            f"{cost} pixels; the limit is {limits.max_decode_pixels} (EPD_VIDEO_MAX_DECODE_"
            "PIXELS): send a shorter or smaller video",
            index,
        )


def check_time(give_up_at: float | None, index: int) -> None:
    """``render.timeout`` once ``time.monotonic()`` is past ``give_up_at``."""
    if give_up_at is not None and time.monotonic() > give_up_at:
        raise _err(
            "render.timeout",
            "decoding the video ran past the render time limit (EPD_API_RENDER_TIMEOUT_S)",
            index,
        )


def finish(img: Image.Image, size: Size | None) -> Image.Image:
    """A kept frame at its final size: the processor's resize (PIL bicubic), done as the frame
    is decoded so that only resized frames are held."""
    if size is None or img.size == size:
        return img
    return img.resize(size, resample=Image.Resampling.BICUBIC)


def _pil(index: int, unreadable: str = "render.video_unreadable") -> AbstractContextManager[None]:
    return pil_errors(
        lambda rule, msg: _err(rule, msg, index),
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
        return _err(rule, f"frame {k}: {msg}", index)

    return pil_errors(
        make, too_large="render.video_too_large", unreadable="render.video_frames", what="frame"
    )


def _open_frames(frames: list[Any], index: int) -> list[Any]:
    """Frames given as encoded image bytes, opened lazily: header read, pixels not decoded, so
    sizes are checked before any frame decodes."""
    out = []
    for k, f in enumerate(frames):
        if isinstance(f, bytes | bytearray | memoryview):
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
            raise _err(
                "render.video_frames",
                f"frame {k}: arrays must be (H, W, 3) uint8, got {f.shape} {f.dtype}",
                index,
            )
        return Image.fromarray(f, "RGB")
    raise _err(
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
    frames = _open_frames(list(src.frames), index)
    if not frames:
        raise _err("render.video_empty", "the frame list is empty", index)
    check_count(len(frames), limits, index)
    w, h = _frame_size(frames[0])
    check_size(w, h, limits, index)
    for k, f in enumerate(frames):
        if _frame_size(f) != (w, h):
            raise _err(
                "render.video_frames",
                f"frame {k} is {'x'.join(map(str, _frame_size(f)))}, frame 0 is {w}x{h}; all "
                "frames of a video must have one size",
                index,
            )
    fps = float(src.fps) if src.fps is not None else limits.fps
    if not math.isfinite(fps) or fps <= 0:
        raise _err("render.video_fps", f"frame rate must be positive, got {src.fps}", index)
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
            raise _err("render.video_unreadable", f"cannot read the GIF: {e}", index) from None
        if not raw:
            raise _err("render.video_empty", "the GIF holds no frames", index)
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
            raise _err("render.video_unreadable", f"cannot read the file: {e}", index) from None
    if not isinstance(src, bytes | bytearray | memoryview):
        raise _err(
            "render.video_type",
            f"unsupported video input type {type(src).__name__} (file bytes, a pathlib.Path, "
            "VideoFrames or a list of frames)",
            index,
        )
    data = bytes(src)
    if max_bytes is not None and len(data) > max_bytes:
        raise _err(
            "render.video_too_large",
            f"video file is {len(data)} bytes; the limit is {max_bytes}",
            index,
        )
    if not data:
        raise _err("render.video_empty", "the video file is empty", index)
    if is_animation(data):
        return plan_animation(data, limits, index)
    from producers.video_file import plan_file  # it builds on this module

    return plan_file(data, limits, index)


def load_video(
    src: VideoInput, limits: VideoLimits, index: int = 0, *, max_bytes: int | None = None
) -> VideoClip:
    """Any accepted video input -> sampled frames at their own size."""
    return plan_video(src, limits, index, max_bytes=max_bytes).clip()
