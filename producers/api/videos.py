"""The ``videos`` field of a JSON submission: each video is one base64 / ``data:`` URL string (an
MP4/MOV, WebM/MKV, animated GIF or WebP file) or a list of such strings for its frames (PNG,
JPEG, WebP, GIF or BMP images). Sizes are checked before base64 decoding (413), types from the
declared ``data:`` type and from magic bytes (415), counts against the settings. The renderer
then checks duration, frame count and pixels from the headers before decoding anything.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from producers.api.data_strings import (
    IMAGE_TYPES,
    DataField,
    decode_data_string,
    sniff_image_type,
)
from producers.api.errors import ApiError, bad_request

VIDEO_TYPES = frozenset(
    {"video/mp4", "video/quicktime", "video/webm", "video/x-matroska", "image/gif", "image/webp"}
)


def sniff_video_type(data: bytes) -> str | None:
    """The video container from magic bytes (MP4/MOV ``ftyp``, Matroska/WebM EBML, animated
    GIF/WebP), or None."""
    if data[4:8] == b"ftyp":
        return "video/mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "video/webm"
    mime = sniff_image_type(data)
    return mime if mime in ("image/gif", "image/webp") else None


VIDEO_FIELD = DataField(
    "videos",
    "video",
    "video",
    "video/mp4",
    "videos must be base64 or data: URLs, or lists of them",
    "video",
)
FRAMES_FIELD = replace(VIDEO_FIELD, noun="video frames")


def _unsupported(msg: str, index: int) -> ApiError:
    return ApiError(
        415,
        "unsupported_media_type",
        msg,
        rule="video.type",
        field="videos",
        item=index,
        modality="video",
    )


def decode_videos(raw: list[Any], settings: Any) -> list[bytes | list[bytes]]:
    """Every video of a submission as file bytes or a list of frame bytes (not yet decoded;
    their number was checked against the request limits already)."""
    limit = settings.api_max_video_bytes
    out: list[bytes | list[bytes]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            data = decode_data_string(item, i, limit, VIDEO_TYPES, VIDEO_FIELD)
            if not data:
                raise bad_request("video is empty", rule="video.empty", field="videos", item=i)
            if sniff_video_type(data) is None:
                raise _unsupported(
                    "video is not MP4/MOV, WebM/MKV, GIF or WebP (checked by its leading bytes)",
                    i,
                )
            out.append(data)
            continue
        if len(item) > settings.video_max_source_frames:
            raise ApiError(
                413,
                "too_large",
                f"the frame list has {len(item)} frames; the limit is "
                f"{settings.video_max_source_frames} (EPD_VIDEO_MAX_SOURCE_FRAMES)",
                rule="video.frames",
                field="videos",
                item=i,
                modality="video",
            )
        frames: list[bytes] = []
        left = limit
        for text in item:
            data = decode_data_string(text, i, left, IMAGE_TYPES, FRAMES_FIELD)
            if sniff_image_type(data) is None:
                raise _unsupported(f"frame {len(frames)} is not an accepted image type", i)
            left -= len(data)
            frames.append(data)
        out.append(frames)
    return out
