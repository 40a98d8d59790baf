"""What every kind of video input becomes before a kept frame is decoded: a :class:`VideoPlan`,
checked against :class:`VideoLimits`; and what it becomes after: a :class:`VideoClip`.

The building blocks the three kinds share (:mod:`media.video` for frame lists and animated
images, :mod:`media.video_file` for files): the limits, the plan and clip, the sampling of
frame indices, the checks each kind applies from its headers, and the frame finisher. A module
of its own, below both, so neither imports the other in a circle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image

from media.image_structure import StructureLimits
from schemas.errors import ValidationError

if TYPE_CHECKING:
    from runtime.settings import Settings

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
    structure: StructureLimits = field(default_factory=StructureLimits)
    """Scans and chunks of each frame given as an encoded image (as for images)."""

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
            structure=StructureLimits.from_settings(settings),
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


def video_error(rule: str, msg: str, index: int) -> VideoError:
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
        raise video_error(
            "render.video_too_large",
            f"video frames are {w}x{h} = {w * h} pixels; the limit is {limits.max_frame_pixels}",
            index,
        )


def check_duration(seconds: float, limits: VideoLimits, index: int) -> None:
    """``render.video_too_long`` past ``max_duration_s``."""
    if seconds > limits.max_duration_s:
        raise video_error(
            "render.video_too_long",
            f"video lasts {seconds:.1f} s; the limit is {limits.max_duration_s:g} s",
            index,
        )


def check_count(frames: int, limits: VideoLimits, index: int) -> None:
    """``render.video_too_many_frames`` past ``max_source_frames``."""
    if frames > limits.max_source_frames:
        raise video_error(
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
        raise video_error(
            "render.video_decode_budget",
            f"reaching the sampled frames means decoding {frames} frames of {w}x{h}{how} = "
            f"{cost} pixels; the limit is {limits.max_decode_pixels} (EPD_VIDEO_MAX_DECODE_"
            "PIXELS): send a shorter or smaller video",
            index,
        )


def check_time(give_up_at: float | None, index: int) -> None:
    """``render.timeout`` once ``time.monotonic()`` is past ``give_up_at``."""
    if give_up_at is not None and time.monotonic() > give_up_at:
        raise video_error(
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
