"""Video files (MP4/MOV, WebM/MKV) -> a :class:`~media.video.VideoPlan`, with PyAV (FFmpeg).

Only the named demuxers and a short list of decoders may run on untrusted bytes. The container
and stream headers are checked first (size, codec, duration, frame count). Then the packets are
demuxed, which reads bytes but decodes nothing: their count is the true frame count, their
timestamps the true duration (measured from the first frame, so a clip cut from a longer
recording, whose timestamps start at 700 s, is as long as it plays), and their keyframe flags
split the stream into groups of pictures (GOPs). Only the GOPs that hold a sampled frame are
decoded (a GOP decodes from its keyframe; one whose leading frames refer back also needs the GOP
before it), so the decode budget is known exactly before the first frame decodes.

Frames are turned upright by the stream's display matrix (a phone's portrait video is stored as
landscape pixels plus a rotation, which ``frame.to_image()`` ignores).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

from PIL import Image

from media.video_plan import (
    Size,
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

CONTAINER_FORMATS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm")
"""The demuxers (FFmpeg names) a video file may reach: MP4/MOV and Matroska/WebM."""
VIDEO_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "libdav1d", "mpeg4")
"""The decoders a video stream may reach; anything else is refused before decoding."""
ROTATIONS = {
    90: Image.Transpose.ROTATE_90,
    180: Image.Transpose.ROTATE_180,
    270: Image.Transpose.ROTATE_270,
}
"""A display matrix's counter-clockwise rotation (``VideoFrame.rotation``) -> PIL transpose."""


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
        raise video_error(
            "render.video_empty", "the file ends before its first video frame", index
        ) from None
    except (av.FFmpegError, ValueError, OSError) as e:
        raise video_error(
            "render.video_unreadable",
            "not a video file in an accepted container (MP4/MOV, WebM/MKV) or corrupt: "
            f"{type(e).__name__}: {e}",
            index,
        ) from None


@dataclass(frozen=True, slots=True)
class VideoHeader:
    """What a file's headers say, before any packet is read."""

    container: str
    codec: str
    width: int
    height: int
    duration_s: float | None
    """From the first frame on (a container's start offset is not part of it)."""
    frames: int | None
    fps: float


def _header(container: Any, index: int) -> VideoHeader:
    if not container.streams.video:
        raise video_error("render.video_empty", "the file holds no video stream", index)
    s = container.streams.video[0]
    rate = s.average_rate or s.guessed_rate or s.base_rate
    duration = None
    if s.duration and s.time_base:
        duration = float(s.duration * s.time_base)
    elif container.duration:
        # Matroska's container duration runs from time 0, not from the first frame.
        duration = (container.duration - (container.start_time or 0)) / 1_000_000
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
        raise video_error(
            "render.video_format", f"container {h.container!r} is not accepted", index
        )
    if h.codec not in VIDEO_CODECS:
        raise video_error(
            "render.video_codec",
            f"video codec {h.codec!r} is not accepted ({', '.join(VIDEO_CODECS)} are)",
            index,
        )
    check_size(h.width, h.height, limits, index)
    if h.duration_s is not None:
        check_duration(h.duration_s, limits, index)
    expected = h.frames
    if expected is None and h.duration_s is not None and h.fps > 0:
        expected = max(1, round(h.duration_s * h.fps))
    if expected is not None:
        check_count(expected, limits, index)
    return expected or 0


def _unreadable(e: Exception, what: str, index: int) -> Exception:
    return video_error("render.video_unreadable", f"cannot {what}: {type(e).__name__}: {e}", index)


def _demux(container: Any, stream: Any, limits: VideoLimits, index: int) -> list[Any]:
    """The stream's packets in decode order (bytes read, nothing decoded), held to the frame
    limit as they come (the header may lie)."""
    import av

    packets = []
    try:
        for p in container.demux(stream):
            if p.size:
                packets.append(p)
                check_count(len(packets), limits, index)
    except av.FFmpegError as e:
        raise _unreadable(e, "read the video packets", index) from None
    if not packets:
        raise video_error("render.video_empty", "the video stream holds no frames", index)
    return packets


def _gops(packets: list[Any]) -> list[list[int]]:
    """Packet indices grouped from each keyframe to the next, in decode order."""
    gops: list[list[int]] = []
    for i, p in enumerate(packets):
        if p.is_keyframe or not gops:
            gops.append([])
        gops[-1].append(i)
    return gops


def _drain(cc: Any, take: Any) -> None:
    """Emit the frames the decoder still holds, then reset it for a jump to another keyframe."""
    for frame in cc.decode(None):
        take(frame)
    cc.flush_buffers()


def _probe_rotation(stream: Any, packets: list[Any], index: int) -> int:
    """The display rotation (degrees counter-clockwise, 0/90/180/270), from the first frame:
    PyAV exposes the display matrix on frames only. Costs one decoded frame."""
    import av

    cc = stream.codec_context
    rotation = 0
    try:
        for frame in [*cc.decode(packets[0]), *cc.decode(None)][:1]:
            rotation = int(frame.rotation)
        cc.flush_buffers()
    except av.FFmpegError as e:
        raise _unreadable(e, "decode the first frame", index) from None
    return round(rotation / 90) * 90 % 360


def plan_file(data: bytes, limits: VideoLimits, index: int = 0) -> VideoPlan:
    """Plan a video file: headers, packets and decode budget checked; frames decode later."""
    container = _open_container(data, index)
    try:
        return _plan(container, limits, index)
    except BaseException:
        container.close()
        raise


def _plan(container: Any, limits: VideoLimits, index: int) -> VideoPlan:
    header = _header(container, index)
    check_header(header, limits, index)
    stream = container.streams.video[0]
    packets = _demux(container, stream, limits, index)
    total = len(packets)
    stamps = [p.pts if p.pts is not None else p.dts for p in packets]
    timed = None not in stamps and len(set(stamps)) == total
    tb = float(stream.time_base or 0)
    if timed and tb > 0:
        order = sorted(stamps)
        last = packets[stamps.index(order[-1])]
        tail = float(last.duration or 0) * tb or (1 / header.fps if header.fps else 0.0)
        # From the first frame's timestamp: a clip may start at any time.
        seconds = (order[-1] - order[0]) * tb + tail
        check_duration(seconds, limits, index)
    else:  # no usable timestamps: frames are taken in decode order, from the header's rate
        timed, order = False, list(range(total))
        seconds = total / header.fps if header.fps else 0.0
    native = header.fps or (total / seconds if seconds > 0 else limits.fps)
    keep = sample_indices(total, native, limits)
    targets = [order[i] for i in keep]
    gops = _gops(packets)
    gop_of = {i: g for g, members in enumerate(gops) for i in members}
    if timed:
        where = {stamps[i]: gop_of[i] for i in range(total)}
        needed = {where[t] for t in targets}
        # An open GOP's leading frames (shown before its keyframe) refer to the GOP before it.
        for g in sorted(needed):
            key = stamps[gops[g][0]]
            if g > 0 and any(stamps[i] < key for i in gops[g]):
                needed.add(g - 1)
    else:
        needed = set(range(gop_of[max(keep)] + 1))
    rotation = _probe_rotation(stream, packets, index)
    w, h = (header.height, header.width) if rotation in (90, 270) else (header.width, header.height)
    decode_frames = 1 + sum(len(gops[g]) for g in needed)  # 1: the rotation probe
    check_budget(decode_frames, header.width, header.height, limits, index)

    def decode(size: Size | None, give_up_at: float | None) -> list[Image.Image]:
        return _decode(
            stream, packets, gops, sorted(needed), targets, timed, header, rotation, limits,
            index, size, give_up_at,
        )  # fmt: skip

    return VideoPlan("file", w, h, total, keep, native, decode_frames, decode, container.close)


def _decode(
    stream: Any,
    packets: list[Any],
    gops: list[list[int]],
    needed: list[int],
    targets: list[int],
    timed: bool,
    header: VideoHeader,
    rotation: int,
    limits: VideoLimits,
    index: int,
    size: Size | None,
    give_up_at: float | None,
) -> list[Image.Image]:
    """Decode the needed GOPs; convert (RGB, upright, resized) only the target frames."""
    import av

    cc = stream.codec_context
    wanted = set(targets)
    got: dict[int, Image.Image] = {}
    seen = [0]  # frames out of the decoder (their identity when timestamps are unusable)

    def take(frame: Any) -> None:
        if (frame.width, frame.height) != (header.width, header.height):
            raise video_error(
                "render.video_frames",
                f"a frame is {frame.width}x{frame.height}, the stream header says "
                f"{header.width}x{header.height}",
                index,
            )
        check_time(give_up_at, index)
        key = frame.pts if timed else seen[0]
        seen[0] += 1
        if key in wanted and key not in got:
            img = frame.to_image()
            if rotation:
                img = img.transpose(ROTATIONS[rotation])
            got[key] = finish(img, size)

    previous = None
    try:
        for g in needed:
            if len(got) == len(wanted):
                break
            if previous is not None and g != previous + 1:
                _drain(cc, take)  # a jump: start clean at this GOP's keyframe
            for i in gops[g]:
                for frame in cc.decode(packets[i]):
                    take(frame)
            previous = g
        _drain(cc, take)
    except av.FFmpegError as e:
        raise _unreadable(e, f"decode the video (frame {seen[0]})", index) from None
    if not got:
        raise video_error("render.video_empty", "the video stream decodes to no frames", index)
    check_count(seen[0], limits, index)
    return _fill_targets(targets, got)


def _fill_targets(targets: list[int], got: dict[int, Image.Image]) -> list[Image.Image]:
    """One frame per target, in order: a target the decoder did not emit (a broken reference)
    takes the nearest earlier frame (the first decoded one when none is earlier)."""
    out, last = [], None
    for t in targets:
        last = got.get(t, last)
        out.append(last if last is not None else next(iter(got.values())))
    return out
