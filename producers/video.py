"""Video inputs -> sampled RGB frames, with every limit checked before decoding.

Three kinds of input become one :class:`VideoClip` (the sampled frames and their rate):

- a file's bytes (MP4/MOV, WebM/MKV) decoded with PyAV (FFmpeg). Only those demuxers and a short
  list of decoders may run on untrusted bytes. Duration, frame count and frame size are read from
  the container and stream headers and checked *before* any frame is decoded; the decoder is then
  held to the same limits (a header may lie) and stops at the last frame it needs;
- an animated GIF or WebP (Pillow), its size and frame count checked from the header first;
- a list of frames (PIL images or ``(H, W, 3)`` uint8 arrays), optionally wrapped in
  :class:`VideoFrames` to give their rate.

Frames are sampled as the Qwen2-VL video processor samples them (``sample_frames`` with ``fps``):
``EPD_VIDEO_FPS`` frames per second, at least 4, at most ``EPD_VIDEO_MAX_FRAMES``, rounded down to
a multiple of the temporal patch size, spread evenly over the source frames.

All of this is CPU-bound and synchronous; the renderer runs it in a worker thread.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from schemas.errors import ValidationError

if TYPE_CHECKING:
    from runtime.settings import Settings

CONTAINER_FORMATS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
"""The demuxers (FFmpeg names) a video file may reach: MP4/MOV and Matroska/WebM."""
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4")
"""The decoders a video stream may reach; anything else is refused before decoding."""
ANIMATION_FORMATS = ("GIF", "WEBP")
"""Pillow decoders for animated images given as a video."""
MIN_FRAMES = 4
"""The Qwen2-VL video processor's ``min_frames``: short clips still get this many frames."""


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


def _check_size(w: int, h: int, limits: VideoLimits, index: int) -> None:
    if w <= 0 or h <= 0 or w * h > limits.max_frame_pixels:
        raise _err(
            "render.video_too_large",
            f"video frames are {w}x{h} = {w * h} pixels; the limit is {limits.max_frame_pixels}",
            index,
        )


def _check_duration(seconds: float, limits: VideoLimits, index: int) -> None:
    if seconds > limits.max_duration_s:
        raise _err(
            "render.video_too_long",
            f"video lasts {seconds:.1f} s; the limit is {limits.max_duration_s:g} s",
            index,
        )


def _check_count(frames: int, limits: VideoLimits, index: int) -> None:
    if frames > limits.max_source_frames:
        raise _err(
            "render.video_too_many_frames",
            f"video has {frames} frames; the limit is {limits.max_source_frames}",
            index,
        )


# ---------------------------------------------------------------------------------------------
# frame lists


FRAME_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""PIL decoders a frame given as encoded bytes may reach (its first frame is used)."""


def _open_frames(frames: list[Any], index: int) -> list[Any]:
    """Frames given as encoded image bytes, opened lazily: header read, pixels not decoded, so
    sizes are checked before any frame decodes."""
    out = []
    for k, f in enumerate(frames):
        if isinstance(f, bytes | bytearray | memoryview):
            try:
                f = Image.open(io.BytesIO(bytes(f)), formats=FRAME_FORMATS)
            except (OSError, ValueError, SyntaxError, EOFError) as e:
                msg = f"frame {k}: not an image in an accepted format ({e})"
                raise _err("render.video_frames", msg, index) from None
        out.append(f)
    return out


def _frame_image(f: Any, k: int, index: int) -> Image.Image:
    if isinstance(f, Image.Image):
        try:
            f.load()
            return f.convert("RGB") if f.mode != "RGB" else f
        except (OSError, ValueError, SyntaxError, EOFError) as e:
            raise _err("render.video_frames", f"frame {k}: cannot decode: {e}", index) from None
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
        return f.size
    if isinstance(f, np.ndarray) and f.ndim >= 2:
        return int(f.shape[1]), int(f.shape[0])
    return (0, 0)


def clip_from_frames(src: VideoFrames, limits: VideoLimits, index: int = 0) -> VideoClip:
    """Sample a caller's frame list; every frame must have the first frame's size."""
    frames = _open_frames(list(src.frames), index)
    if not frames:
        raise _err("render.video_empty", "the frame list is empty", index)
    _check_count(len(frames), limits, index)
    w, h = _frame_size(frames[0])
    _check_size(w, h, limits, index)
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
    _check_duration(len(frames) / fps, limits, index)
    keep = sample_indices(len(frames), fps, limits)
    out = [_frame_image(frames[i], i, index) for i in keep]
    return VideoClip(out, len(keep) / len(frames) * fps, len(frames), "frames")


# ---------------------------------------------------------------------------------------------
# animated GIF / WebP


def is_animation(data: bytes) -> bool:
    """GIF or WebP by magic bytes (the only image formats accepted as a video)."""
    return data[:6] in (b"GIF87a", b"GIF89a") or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")


@contextmanager
def _pil_errors(index: int) -> Iterator[None]:
    try:
        yield
    except VideoError:
        raise
    except Image.DecompressionBombError as e:
        raise _err("render.video_too_large", f"decompression bomb refused: {e}", index) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise _err("render.video_unreadable", f"cannot decode animation: {e}", index) from None


def webp_durations(data: bytes) -> list[int]:
    """Per-frame durations (ms) of an animated WebP, from its ANMF chunk headers (no decoding:
    Pillow reports a WebP frame's duration only after decoding it). Empty for a still WebP."""
    out: list[int] = []
    pos = 12  # "RIFF" size "WEBP"
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if kind == b"ANMF" and size >= 16:
            out.append(int.from_bytes(data[pos + 20 : pos + 23], "little"))
        pos += 8 + size + (size & 1)
    return out


def _durations_ms(img: Image.Image, data: bytes, total: int) -> list[float]:
    if img.format == "WEBP":
        raw: list[float] = [float(d) for d in webp_durations(data)] or [0.0] * total
    else:
        raw = []
        for k in range(total):  # GIF: each frame's delay is read when seeking to it
            img.seek(k)
            raw.append(float(img.info.get("duration") or 0.0))
    # Browsers show a 0 ms frame for 100 ms; use that rate too.
    return [d or 100.0 for d in raw[:total]]


def clip_from_animation(data: bytes, limits: VideoLimits, index: int = 0) -> VideoClip:
    """Sample an animated GIF/WebP; size, frame count and duration are checked before any
    frame's pixels are kept."""
    with _pil_errors(index):
        img = Image.open(io.BytesIO(data), formats=ANIMATION_FORMATS)
        _check_size(*img.size, limits, index)
        total = int(getattr(img, "n_frames", 1))
        _check_count(total, limits, index)
        seconds = sum(_durations_ms(img, data, total)) / 1000.0
        _check_duration(seconds, limits, index)
        native = total / seconds if seconds > 0 else limits.fps
        keep = sample_indices(total, native, limits)
        frames = []
        for k in keep:
            img.seek(k)
            frames.append(img.convert("RGB"))
    return VideoClip(frames, len(keep) / total * native, total, "animation")


# ---------------------------------------------------------------------------------------------
# video files (PyAV)


def _open_container(data: bytes, index: int) -> Any:
    import av

    try:
        return av.open(
            io.BytesIO(data),
            mode="r",
            # Only these demuxers and decoders run on untrusted bytes.
            container_options={
                "format_whitelist": ",".join(CONTAINER_FORMATS),
                "codec_whitelist": ",".join(VIDEO_CODECS),
            },
        )
    except av.EOFError:
        raise _err(
            "render.video_empty", "the file ends before its first video frame", index
        ) from None
    except (av.FFmpegError, ValueError, OSError) as e:
        raise _err(
            "render.video_unreadable",
            "not a video file in an accepted container (MP4/MOV, WebM/MKV) or corrupt: "
            f"{type(e).__name__}: {e}",
            index,
        ) from None


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What a file's headers say, before any frame is decoded."""

    container: str
    codec: str
    width: int
    height: int
    duration_s: float | None
    frames: int | None
    fps: float


def _header(container: Any, index: int) -> VideoHeader:
    if not container.streams.video:
        raise _err("render.video_empty", "the file holds no video stream", index)
    s = container.streams.video[0]
    rate = s.average_rate or s.guessed_rate or s.base_rate
    duration = None
    if s.duration and s.time_base:
        duration = float(s.duration * s.time_base)
    elif container.duration:
        duration = container.duration / 1_000_000
    return VideoHeader(
        container=container.format.name,
        codec=s.codec_context.name,
        width=int(s.codec_context.width or s.width or 0),
        height=int(s.codec_context.height or s.height or 0),
        duration_s=duration,
        frames=int(s.frames) or None,
        fps=float(rate) if rate else 0.0,
    )


def check_header(h: VideoHeader, limits: VideoLimits, index: int = 0) -> int:
    """Apply the limits to a header; returns the expected frame count (0: header says none)."""
    if h.container not in CONTAINER_FORMATS:
        raise _err("render.video_format", f"container {h.container!r} is not accepted", index)
    if h.codec not in VIDEO_CODECS:
        raise _err(
            "render.video_codec",
            f"video codec {h.codec!r} is not accepted ({', '.join(VIDEO_CODECS)} are)",
            index,
        )
    _check_size(h.width, h.height, limits, index)
    if h.duration_s is not None:
        _check_duration(h.duration_s, limits, index)
    expected = h.frames
    if expected is None and h.duration_s is not None and h.fps > 0:
        expected = max(1, round(h.duration_s * h.fps))
    if expected is not None:
        _check_count(expected, limits, index)
    return expected or 0


def clip_from_file(data: bytes, limits: VideoLimits, index: int = 0) -> VideoClip:
    """Decode the frames to keep from a video file's bytes (headers checked first)."""
    import av

    container = _open_container(data, index)
    try:
        header = _header(container, index)
        expected = check_header(header, limits, index)
        if expected <= 0:
            raise _err("render.video_empty", "the video stream holds no frames", index)
        keep = sample_indices(expected, header.fps or limits.fps, limits)
        wanted, last = set(keep), max(keep)
        frames: list[Image.Image] = []
        decoded = 0
        stream = container.streams.video[0]
        try:
            for frame in container.decode(stream):
                # The header may lie: hold the decoder to the same limits.
                _check_count(decoded + 1, limits, index)
                _check_size(frame.width, frame.height, limits, index)
                if (frame.width, frame.height) != (header.width, header.height):
                    raise _err(
                        "render.video_frames",
                        f"frame {decoded} is {frame.width}x{frame.height}, the stream header "
                        f"says {header.width}x{header.height}",
                        index,
                    )
                if frame.time is not None:
                    _check_duration(float(frame.time), limits, index)
                if decoded in wanted:
                    frames.append(frame.to_image())
                decoded += 1
                if decoded > last:
                    break
        except av.FFmpegError as e:
            raise _err(
                "render.video_unreadable",
                f"cannot decode frame {decoded}: {type(e).__name__}: {e}",
                index,
            ) from None
    finally:
        container.close()
    if decoded == 0:
        raise _err("render.video_empty", "the video stream decodes to no frames", index)
    fps = header.fps or limits.fps
    return VideoClip(frames, len(frames) / max(expected, 1) * fps, expected, "file")


# ---------------------------------------------------------------------------------------------
# dispatch


def load_video(
    src: VideoInput, limits: VideoLimits, index: int = 0, *, max_bytes: int | None = None
) -> VideoClip:
    """Any accepted video input -> sampled frames. Raises ``VideoError`` naming rule and item."""
    if isinstance(src, VideoFrames):
        return clip_from_frames(src, limits, index)
    if isinstance(src, Sequence) and not isinstance(src, str | bytes | bytearray | memoryview):
        return clip_from_frames(VideoFrames(src), limits, index)
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
        return clip_from_animation(data, limits, index)
    return clip_from_file(data, limits, index)
