"""The ``videos`` field of a JSON submission: each video is one base64 / ``data:`` URL string (an
MP4/MOV, WebM/MKV, animated GIF or WebP file) or a list of such strings for its frames (PNG,
JPEG, WebP, GIF or BMP images). Sizes are checked before base64 decoding (413), types from the
declared ``data:`` type and from magic bytes (415), counts against the settings. The renderer
then checks duration, frame count and pixels from the headers before decoding anything.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from producers.api.errors import ApiError, bad_request
from producers.api.intake import IMAGE_TYPES, sniff_image_type

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


def _too_large(what: str, size: int, limit: int, index: int) -> ApiError:
    return ApiError(
        413,
        "too_large",
        f"{what} is about {size} bytes; the limit is {limit}",
        rule="video.size",
        field="videos",
        item=index,
        modality="video",
    )


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


def _decode(text: str, index: int, limit: int, types: frozenset[str], what: str) -> bytes:
    payload = text
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise bad_request(
                "a data: URL must look like data:video/mp4;base64,<data>",
                rule="video.encoding",
                field="videos",
                item=index,
            )
        mime = header[5:].split(";", 1)[0].strip().lower()
        if mime not in types:
            raise _unsupported(f"data: URL type {mime!r} is not one of {sorted(types)}", index)
    if len(payload) // 4 * 3 > limit + 3:
        raise _too_large(what, len(payload) // 4 * 3, limit, index)
    compact = "".join(payload.split()) if any(c.isspace() for c in payload[:4096]) else payload
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(
            "videos must be base64 or data: URLs, or lists of them (file paths and URLs are "
            "not accepted)",
            rule="video.encoding",
            field="videos",
            item=index,
        ) from None


def decode_videos(raw: list[Any], settings: Any) -> list[bytes | list[bytes]]:
    """Every video of a submission as file bytes or a list of frame bytes (not yet decoded)."""
    if len(raw) > settings.api_max_videos:
        raise ApiError(
            413,
            "too_large",
            f"{len(raw)} videos; the limit is {settings.api_max_videos}",
            rule="video.count",
            field="videos",
        )
    limit = settings.api_max_video_bytes
    out: list[bytes | list[bytes]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            data = _decode(item, i, limit, VIDEO_TYPES, "video")
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
            raise _too_large("frame list", len(item), settings.video_max_source_frames, i)
        frames: list[bytes] = []
        left = limit
        for text in item:
            data = _decode(text, i, left, IMAGE_TYPES, "video frames")
            if sniff_image_type(data) is None:
                raise _unsupported(f"frame {len(frames)} is not an accepted image type", i)
            left -= len(data)
            frames.append(data)
        out.append(frames)
    return out
