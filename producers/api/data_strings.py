"""Image and video strings of a request body: base64 or ``data:`` URLs, sized before decoding.

Shared by the image fields (:mod:`producers.api.bodies`) and the video fields
(:mod:`producers.api.videos`). An image's encoded size is checked before it is base64-decoded
and its type is sniffed from magic bytes before any decoder sees it. Strings are data only:
nothing here opens a file or fetches a URL.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass

from producers.api.errors import ApiError, bad_request
from producers.image_structure import StructureLimits, too_complex

# Magic bytes of the image formats the renderer decodes (producers.pictures.IMAGE_FORMATS:
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
    why = None if structure is None else too_complex(data, structure)
    if why is not None:
        raise ApiError(
            413,
            "too_large",
            why,
            rule="render.image_too_complex",
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
            f"{where.hint}: {base64_problem(payload)}",
            rule=f"{where.rule}.encoding",
            field=where.field,
            item=index,
        ) from None


def decode_image_string(text: str, index: int, limit: int) -> bytes:
    """Bytes of one ``images`` string (:func:`decode_data_string`)."""
    return decode_data_string(text, index, limit, IMAGE_TYPES, IMAGE_FIELD)
