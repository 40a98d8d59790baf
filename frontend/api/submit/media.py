"""Image and video strings of a request body: base64 or ``data:`` URLs, sized before decoding.

An image's encoded size is checked before it is base64-decoded and its type is sniffed from
magic bytes before any decoder sees it; pixel counts are checked by the renderer from the
header before pixels are decompressed. The ``videos`` field of a JSON submission holds, per
video, one base64 / ``data:`` URL string (an MP4/MOV, WebM/MKV, animated GIF or WebP file) or
a list of such strings for its frames (PNG, JPEG, WebP, GIF or BMP images); the renderer then
checks duration, frame count and pixels from the headers before decoding anything. Strings
are data only: nothing here opens a file or fetches a URL (allowed ``http(s)`` URLs are
:mod:`frontend.api.submit.media_urls`'s).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, replace
from typing import Any

from frontend.api.errors import ApiError, bad_request
from frontend.api.submit.media_urls import MediaRef
from media.image_structure import StructureLimits, too_complex

# Magic bytes of the image formats the renderer decodes (media.pictures.IMAGE_FORMATS:
# PNG, JPEG, WebP, GIF, BMP); anything else is 415.
IMAGE_MAGIC: tuple[tuple[str, bytes, int], ...] = (
    ("image/png", b"\x89PNG\r\n\x1a\n", 0),
    ("image/jpeg", b"\xff\xd8\xff", 0),
    ("image/gif", b"GIF87a", 0),
    ("image/gif", b"GIF89a", 0),
    ("image/webp", b"WEBP", 8),  # RIFF....WEBP
    ("image/bmp", b"BM", 0),  # and a DIB header size at 14, checked below
)
IMAGE_TYPES = frozenset(t for t, _, _ in IMAGE_MAGIC)
BMP_DIB_SIZES = frozenset({12, 40, 52, 56, 64, 108, 124})
"""Sizes of the BMP info headers Pillow reads ("BM" alone is too weak a magic)."""
STD_BASE64 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://|[A-Za-z]:\\|file:")


def sniff_image_type(data: bytes) -> str | None:
    """The image type from magic bytes, or None when it is not an accepted format."""
    for mime, magic, offset in IMAGE_MAGIC:
        if data[offset : offset + len(magic)] == magic:
            if mime == "image/webp" and data[:4] != b"RIFF":
                continue
            if mime == "image/bmp" and int.from_bytes(data[14:18], "little") not in BMP_DIB_SIZES:
                continue
            return mime
    return None


def base64_problem(text: str) -> str:
    """What is wrong with a string that is not standard base64, in words a client can act on
    (checked only once decoding failed)."""
    if (
        _URL_SCHEME.match(text)
        or text.startswith(("./", "../", "~/"))
        or (text.startswith("/") and len(text) < 1024 and ("." in text or text.count("/") > 1))
    ):
        return "this looks like a file path or URL; send the file's bytes (base64), not a name"
    bad = next(
        ((i, c) for i, c in enumerate(text) if c not in STD_BASE64 and not c.isspace()), None
    )
    text = "".join(text.split())  # line breaks are fine (MIME wraps base64)
    if bad is not None and bad[1] in "-_" and all(c in STD_BASE64 or c in "-_" for c in text):
        return "URL-safe base64 ('-' and '_') is not accepted; use the standard alphabet ('+', '/')"
    if bad is not None:
        return f"character {bad[1]!r} at position {bad[0]} is not base64"
    if len(text) % 4:
        return (
            f"the base64 text has {len(text)} characters, not a multiple of 4: is its "
            "'=' padding missing?"
        )
    return "the base64 padding ('=') is misplaced"


def check_image_bytes(
    data: bytes, index: int, limit: int, structure: StructureLimits | None = None
) -> str:
    """Size, type and (given ``structure``) decode cost of one image's file bytes, as soon as
    they are known; returns its MIME type (413/415 otherwise). The renderer counts the
    structure again before it decodes (images that reach it another way)."""
    if len(data) > limit:
        message = f"image is {len(data)} bytes; the limit is {limit}"
        raise refused(413, message, "image.size", index, "images", "image")
    if not data:
        raise bad_request("image is empty", rule="image.empty", field="images", item=index)
    mime = sniff_image_type(data)
    if mime is None:
        message = f"image is not one of {sorted(IMAGE_TYPES)} (checked by its leading bytes)"
        raise refused(415, message, "image.type", index, "images", "image")
    why = None if structure is None else too_complex(data, structure)
    if why is not None:
        raise refused(413, why, "render.image_too_complex", index, "images", "image")
    return mime


CODES = {413: "too_large", 415: "unsupported_media_type"}


def refused(
    status: int, message: str, rule: str, index: int, field: str, modality: str
) -> ApiError:
    """A media item refused for its size (413) or its type (415), naming its field and index."""
    return ApiError(
        status, CODES[status], message, rule=rule, field=field, item=index, modality=modality
    )


@dataclass(frozen=True, slots=True)
class DataField:
    """How one request field's base64 / ``data:`` URL strings are named in errors."""

    field: str
    """The body field (``images``, ``videos``)."""
    rule: str
    """Rule prefix: ``image`` gives ``image.encoding``, ``image.type``, ``image.size``."""
    noun: str
    """What one string holds, for messages (``image``, ``video``, ``video frames``)."""
    example: str
    """A ``data:`` type for the help text."""
    hint: str
    """What the field accepts, for the 400 message."""
    modality: str


IMAGE_FIELD = DataField(
    "images", "image", "image", "image/png", "images must be base64 or data: URLs", "image"
)


def decode_data_string(
    text: str, index: int, limit: int, types: frozenset[str], where: DataField
) -> bytes:
    """Bytes of a base64 string or ``data:`` URL; size checked before decoding (413), the
    declared type checked against ``types`` (415); anything else, file paths included, is 400."""
    payload = text
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise bad_request(
                f"a data: URL must look like data:{where.example};base64,<data>",
                rule=f"{where.rule}.encoding",
                field=where.field,
                item=index,
            )
        mime = header[5:].split(";", 1)[0].strip().lower()
        if mime not in types:
            message = f"data: URL type {mime!r} is not one of {sorted(types)}"
            raise refused(415, message, f"{where.rule}.type", index, where.field, where.modality)
    # Upper bound of the decoded size, known without decoding anything.
    if len(payload) // 4 * 3 > limit + 3:
        message = f"{where.noun} is about {len(payload) // 4 * 3} bytes; the limit is {limit}"
        raise refused(413, message, f"{where.rule}.size", index, where.field, where.modality)
    compact = "".join(payload.split()) if any(c.isspace() for c in payload[:4096]) else payload
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(
            f"{where.hint}: {base64_problem(payload)}",
            rule=f"{where.rule}.encoding",
            field=where.field,
            item=index,
        ) from None


def decode_image_string(text: str, index: int, limit: int) -> bytes:
    """Bytes of one ``images`` string (:func:`decode_data_string`)."""
    return decode_data_string(text, index, limit, IMAGE_TYPES, IMAGE_FIELD)


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


NOT_A_VIDEO = "video is not MP4/MOV, WebM/MKV, GIF or WebP (checked by its leading bytes)"


def _unsupported(msg: str, index: int) -> ApiError:
    return refused(415, msg, "video.type", index, "videos", "video")


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
                raise _unsupported(NOT_A_VIDEO, i)
            out.append(data)
            continue
        if len(item) > settings.video_max_source_frames:
            message = (
                f"the frame list has {len(item)} frames; the limit is "
                f"{settings.video_max_source_frames} (EPD_VIDEO_MAX_SOURCE_FRAMES)"
            )
            raise refused(413, message, "video.frames", i, "videos", "video")
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


def decode_part(url: str, ref: MediaRef, settings: Any) -> bytes:
    """A conversation part's ``data:`` URL as bytes, size and type checked, errors naming the
    part (``ref.field``)."""
    try:
        if ref.modality == "image":
            where = replace(IMAGE_FIELD, field=ref.field)
            data = decode_data_string(
                url, ref.item, settings.api_max_image_bytes, IMAGE_TYPES, where
            )
            structure = StructureLimits.from_settings(settings)
            check_image_bytes(data, ref.item, settings.api_max_image_bytes, structure)
            return data
        where = replace(VIDEO_FIELD, field=ref.field)
        data = decode_data_string(url, ref.item, settings.api_max_video_bytes, VIDEO_TYPES, where)
        if not data or sniff_video_type(data) is None:
            raise _unsupported(NOT_A_VIDEO, ref.item)
        return data
    except ApiError as exc:
        exc.field = ref.field  # the part, not the native API's field name
        raise
