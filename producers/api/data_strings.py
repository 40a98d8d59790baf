"""Image and video strings of a request body: base64 or ``data:`` URLs, sized before decoding.

Shared by the image fields (:mod:`producers.api.bodies`) and the video fields
(:mod:`producers.api.videos`). An image's encoded size is checked before it is base64-decoded
and its type is sniffed from magic bytes before any decoder sees it. Strings are data only:
nothing here opens a file or fetches a URL.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from producers.api.errors import ApiError, bad_request

# Magic bytes of the image formats the renderer accepts; anything else is 415.
IMAGE_MAGIC: tuple[tuple[str, bytes, int], ...] = (
    ("image/png", b"\x89PNG\r\n\x1a\n", 0),
    ("image/jpeg", b"\xff\xd8\xff", 0),
    ("image/gif", b"GIF87a", 0),
    ("image/gif", b"GIF89a", 0),
    ("image/webp", b"WEBP", 8),  # RIFF....WEBP
)
IMAGE_TYPES = frozenset(t for t, _, _ in IMAGE_MAGIC)


def sniff_image_type(data: bytes) -> str | None:
    """The image type from magic bytes, or None when it is not an accepted format."""
    for mime, magic, offset in IMAGE_MAGIC:
        if data[offset : offset + len(magic)] == magic:
            if mime == "image/webp" and data[:4] != b"RIFF":
                continue
            return mime
    return None


def check_image_bytes(data: bytes, index: int, limit: int) -> str:
    """Size and type of one image's file bytes; returns its MIME type (413/415 otherwise)."""
    if len(data) > limit:
        raise ApiError(
            413,
            "too_large",
            f"image is {len(data)} bytes; the limit is {limit}",
            rule="image.size",
            field="images",
            item=index,
            modality="image",
        )
    if not data:
        raise bad_request("image is empty", rule="image.empty", field="images", item=index)
    mime = sniff_image_type(data)
    if mime is None:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"image is not one of {sorted(IMAGE_TYPES)} (checked by its leading bytes)",
            rule="image.type",
            field="images",
            item=index,
            modality="image",
        )
    return mime


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
            raise ApiError(
                415,
                "unsupported_media_type",
                f"data: URL type {mime!r} is not one of {sorted(types)}",
                rule=f"{where.rule}.type",
                field=where.field,
                item=index,
                modality=where.modality,
            )
    # Upper bound of the decoded size, known without decoding anything.
    if len(payload) // 4 * 3 > limit + 3:
        raise ApiError(
            413,
            "too_large",
            f"{where.noun} is about {len(payload) // 4 * 3} bytes; the limit is {limit}",
            rule=f"{where.rule}.size",
            field=where.field,
            item=index,
            modality=where.modality,
        )
    compact = "".join(payload.split()) if any(c.isspace() for c in payload[:4096]) else payload
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(
            f"{where.hint} (file paths and URLs are not accepted)",
            rule=f"{where.rule}.encoding",
            field=where.field,
            item=index,
        ) from None


def decode_image_string(text: str, index: int, limit: int) -> bytes:
    """Bytes of one ``images`` string (:func:`decode_data_string`)."""
    return decode_data_string(text, index, limit, IMAGE_TYPES, IMAGE_FIELD)
