"""Reading and parsing request bodies: size limits first, then structure, then image bytes.

Order matters for safety: the body is counted while it is read (a 50 MB upload is refused at
the limit, never held whole); an image's encoded size is checked before it is base64-decoded;
its type is sniffed from magic bytes before any decoder sees it; pixel counts are checked by
the renderer from the header before pixels are decompressed. Image strings are data only:
base64 or ``data:`` URLs. Nothing here opens a file or fetches a URL.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from producers.api.errors import ApiError, bad_request
from producers.api.models import SubmitRequest

# Magic bytes of the image formats the renderer accepts; anything else is 415.
IMAGE_MAGIC: tuple[tuple[str, bytes, int], ...] = (
    ("image/png", b"\x89PNG\r\n\x1a\n", 0),
    ("image/jpeg", b"\xff\xd8\xff", 0),
    ("image/gif", b"GIF87a", 0),
    ("image/gif", b"GIF89a", 0),
    ("image/webp", b"WEBP", 8),  # RIFF....WEBP
)
IMAGE_TYPES = frozenset(t for t, _, _ in IMAGE_MAGIC)


@dataclass(slots=True)
class SubmitInput:
    """A parsed submission, images as bytes (sniffed, size-checked, not yet decoded)."""

    prompt: str | None
    token_ids: list[int] | None
    images: list[bytes]
    max_tokens: int
    temperature: float
    ignore_eos: bool
    cache_salt: str | None
    deadline_s: float | None
    metadata: dict[str, str] | None
    image_types: list[str] = field(default_factory=list)
    videos: list[bytes | list[bytes]] = field(default_factory=list)

    def fingerprint(self) -> str:
        """A digest of the request's meaning (not its bytes: multipart boundaries and base64
        line breaks differ between identical requests). Used by Idempotency-Key."""
        h = hashlib.sha256()
        h.update(
            json.dumps(
                {
                    "prompt": self.prompt,
                    "token_ids": self.token_ids,
                    "max_tokens": self.max_tokens,
                    "temperature": self.temperature,
                    "ignore_eos": self.ignore_eos,
                    "cache_salt": self.cache_salt,
                    "deadline_s": self.deadline_s,
                    "metadata": self.metadata,
                },
                sort_keys=True,
            ).encode()
        )
        for img in self.images:
            h.update(hashlib.sha256(img).digest())
        for k, video in enumerate(self.videos):
            h.update(f"\0video{k}:".encode())
            for part in [video] if isinstance(video, bytes) else video:
                h.update(hashlib.sha256(part).digest())
        return h.hexdigest()


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request("Content-Length is not a number", rule="body.length")
        if int(declared) > limit:
            raise _body_too_large(int(declared), limit)
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _body_too_large(total, limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    # Later readers (request.form()) parse these bytes instead of the consumed stream.
    request._body = body
    return body


def _body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413, "too_large", f"body is at least {size} bytes; the limit is {limit}", rule="body.size"
    )


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


def _from_model(req: SubmitRequest, images: list[bytes], types: list[str]) -> SubmitInput:
    return SubmitInput(
        prompt=req.prompt,
        token_ids=req.token_ids,
        images=images,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        ignore_eos=req.ignore_eos,
        cache_salt=req.cache_salt,
        deadline_s=req.deadline_s,
        metadata=req.metadata,
        image_types=types,
    )


def pydantic_error(exc: PydanticValidationError) -> ApiError:
    """The first pydantic error as a 422 naming the field."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
    loc = [str(x) for x in first.get("loc", ())]
    item = next((int(x) for x in loc[1:] if x.isdigit()), None)
    return ApiError(
        422,
        "validation_failed",
        f"{'.'.join(loc) or 'body'}: {first.get('msg')}",
        rule="request.schema",
        field=loc[0] if loc else None,
        item=item,
    )


def parse_json_submit(body: bytes, settings: Any) -> SubmitInput:
    """A JSON submission (400 bad JSON, 422 schema, 413/415/400 per image)."""
    try:
        obj = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"body is not JSON: {e}", rule="body.json") from None
    if not isinstance(obj, dict):
        raise bad_request("body must be a JSON object", rule="body.json")
    # Image strings are size-checked before pydantic copies them around.
    raw_images = obj.get("images")
    if isinstance(raw_images, list) and len(raw_images) > settings.api_max_images:
        raise ApiError(
            413,
            "too_large",
            f"{len(raw_images)} images; the limit is {settings.api_max_images}",
            rule="image.count",
            field="images",
        )
    try:
        req = SubmitRequest.model_validate(obj)
    except PydanticValidationError as e:
        raise pydantic_error(e) from None
    images, types = [], []
    for i, text in enumerate(req.images):
        data = decode_image_string(text, i, settings.api_max_image_bytes)
        types.append(check_image_bytes(data, i, settings.api_max_image_bytes))
        images.append(data)
    inp = _from_model(req, images, types)
    if req.videos:
        from producers.api.video_intake import decode_videos  # it imports this module

        inp.videos = decode_videos(req.videos, settings)
    return inp


async def parse_multipart_submit(request: Request, settings: Any) -> SubmitInput:
    """A ``multipart/form-data`` submission: image files (or base64 strings) in ``images``
    parts, the other fields as form values (``token_ids`` and ``metadata`` as JSON)."""
    try:
        form = await request.form(
            max_files=settings.api_max_images, max_fields=64, max_part_size=1024 * 1024
        )
    except Exception as e:  # python-multipart and Starlette raise several types here
        raise bad_request(f"cannot parse the form: {e}", rule="body.form") from None
    try:
        fields: dict[str, Any] = {}
        images: list[bytes] = []
        types: list[str] = []
        for name, value in form.multi_items():
            if name in ("images", "image", "images[]"):
                i = len(images)
                if len(images) >= settings.api_max_images:
                    raise ApiError(
                        413, "too_large", "too many images", rule="image.count", field="images"
                    )
                if isinstance(value, UploadFile):
                    data = await value.read(settings.api_max_image_bytes + 1)
                else:
                    data = decode_image_string(str(value), i, settings.api_max_image_bytes)
                types.append(check_image_bytes(data, i, settings.api_max_image_bytes))
                images.append(data)
            elif isinstance(value, UploadFile):
                raise bad_request(f"unexpected file part {name!r}", rule="body.form", field=name)
            elif name in ("token_ids", "metadata"):
                try:
                    fields[name] = json.loads(value)
                except json.JSONDecodeError:
                    raise bad_request(
                        f"{name} must be JSON in a form", rule="body.form", field=name
                    ) from None
            else:
                fields[name] = value
        try:
            req = SubmitRequest.model_validate(fields)
        except PydanticValidationError as e:
            raise pydantic_error(e) from None
        return _from_model(req, images, types)
    finally:
        await form.close()
