"""Reading and parsing request bodies: size limits first, then structure, then image bytes.

Order matters for safety: the body is counted while it is read (a 50 MB upload is refused at
the limit, never held whole); an image's encoded size is checked before it is base64-decoded;
its type is sniffed from magic bytes before any decoder sees it; pixel counts are checked by
the renderer from the header before pixels are decompressed. Image strings are data only:
base64 or ``data:`` URLs. Nothing here opens a file or fetches a URL.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from producers.api.checks import pydantic_error
from producers.api.data_strings import check_image_bytes, decode_image_string
from producers.api.errors import ApiError, answered, bad_request
from producers.api.models import SubmitRequest
from producers.api.videos import decode_videos
from runtime.request_limits import RequestLimits
from schemas.errors import ValidationError
from schemas.types import SamplingParams
from schemas.vllm_sampling import pipeline_top_k


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
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def sampling(self) -> SamplingParams:
        """The request's sampling parameters (``top_k`` -1 means off, as in vLLM)."""
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            top_p=self.top_p,
            top_k=pipeline_top_k(self.top_k),
            seed=self.seed,
            stop=list(self.stop),
        )

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
                    "top_p": self.top_p,
                    "top_k": self.top_k,
                    "seed": self.seed,
                    "stop": self.stop,
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
    return b"".join(chunks)


def replayed(request: Request, body: bytes) -> Request:
    """A request over the same scope whose body is ``body`` (already read and counted), for
    parsers that read the body themselves (``Request.form``): Starlette's public
    ``Request(scope, receive)`` with a ``receive`` that hands the bytes over once."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(request.scope, receive)


def _body_too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413, "too_large", f"body is at least {size} bytes; the limit is {limit}", rule="body.size"
    )


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
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
    )


def _not_json_number(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259); send a finite number")


def parse_json(body: bytes | str, max_depth: int, *, where: str = "body") -> Any:
    """JSON text as Python values; 400 ``body.json`` for anything else: malformed text,
    ``NaN``/``Infinity`` (Python's parser takes them, JSON has none), objects and arrays
    nested deeper than ``max_depth`` (a deep body would exhaust the parser's recursion or the
    code that walks it), or a string (value or key) holding a lone UTF-16 surrogate (JSON's
    ``"\\ud800"``: Python keeps it as a code point no UTF-8 encoder takes, so the tokenizer,
    the Avro event or Redis would fail on it long after the door)."""
    try:
        obj = json.loads(body, parse_constant=_not_json_number)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"{where} is not JSON: {e}", rule="body.json") from None
    except ValueError as e:  # NaN / Infinity
        raise bad_request(f"{where}: {e}", rule="body.json") from None
    except RecursionError:
        raise bad_request(
            f"{where} is nested too deeply (the limit is {max_depth} levels)", rule="body.json"
        ) from None
    problem = _tree_problem(obj, max_depth)
    if problem == "depth":
        raise bad_request(
            f"{where} is nested too deeply (the limit is {max_depth} levels, "
            "EPD_API_MAX_JSON_DEPTH)",
            rule="body.json",
        )
    if problem == "surrogate":
        raise bad_request(
            f"{where} holds a string with a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
            "escape); send text as valid Unicode",
            rule="body.json",
        )
    return obj


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point: json.loads joins a well-formed escaped pair into one character, so
any left in a parsed string is half a pair."""


def _tree_problem(obj: Any, limit: int) -> str | None:
    """``"depth"`` when objects/arrays nest more than ``limit`` levels, ``"surrogate"`` when a
    string or key holds a lone surrogate, else None (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return "surrogate"
            continue
        if not isinstance(node, dict | list):
            continue  # a number, a boolean, null
        if depth > limit:
            return "depth"
        if isinstance(node, dict):
            stack.extend((k, depth) for k in node)
            children: Any = node.values()
        else:
            children = node
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list | str))
    return None


def _checked(req: SubmitRequest, limits: RequestLimits) -> None:
    """The bounds of a submission the body alone decides (the intake checks the rest)."""
    if (req.prompt is None) == (req.token_ids is None):
        raise ValidationError(
            "render.prompt", "give exactly one of prompt or token_ids", field="prompt"
        )
    limits.check_prompt(req.prompt, req.token_ids)
    limits.check_deadline(req.deadline_s)
    limits.check_sampling(
        req.max_tokens,
        req.temperature,
        top_p=req.top_p,
        top_k=pipeline_top_k(req.top_k),
        seed=req.seed,
        stop=req.stop,
    )


def parse_json_submit(body: bytes, limits: RequestLimits, settings: Any) -> SubmitInput:
    """A JSON submission (400 bad JSON, 422 schema, 413/415/400 per image). CPU-bound for a
    large body (parsing, base64): run it in a worker thread."""
    with answered():
        return _parse_json_submit(body, limits, settings)


def _parse_json_submit(body: bytes, limits: RequestLimits, settings: Any) -> SubmitInput:
    obj = parse_json(body, limits.max_json_depth)
    if not isinstance(obj, dict):
        raise bad_request("body must be a JSON object", rule="body.json")
    # Counted before pydantic copies megabytes of image strings around.
    images, videos = obj.get("images"), obj.get("videos")
    limits.check_counts(
        len(images) if isinstance(images, list) else 0,
        len(videos) if isinstance(videos, list) else 0,
    )
    try:
        req = SubmitRequest.model_validate(obj)
    except PydanticValidationError as e:
        raise pydantic_error(e) from None
    _checked(req, limits)
    datas, types = [], []
    for i, text in enumerate(req.images):
        data = decode_image_string(text, i, settings.api_max_image_bytes)
        types.append(check_image_bytes(data, i, settings.api_max_image_bytes))
        datas.append(data)
    inp = _from_model(req, datas, types)
    if req.videos:
        inp.videos = decode_videos(req.videos, settings)
    return inp


async def parse_multipart_submit(
    request: Request, body: bytes, limits: RequestLimits, settings: Any
) -> SubmitInput:
    """A ``multipart/form-data`` submission (``body``: the bytes :func:`read_body` read):
    image files (or base64 strings) in ``images`` parts, the other fields as form values
    (``token_ids`` and ``metadata`` as JSON)."""
    with answered():
        return await _parse_multipart_submit(request, body, limits, settings)


async def _parse_multipart_submit(
    request: Request, body: bytes, limits: RequestLimits, settings: Any
) -> SubmitInput:
    try:
        form = await replayed(request, body).form(
            max_files=limits.max_images + 1, max_fields=64, max_part_size=1024 * 1024
        )
    except Exception as e:  # python-multipart and Starlette raise several types here
        raise bad_request(f"cannot parse the form: {e}", rule="body.form") from None
    try:
        fields: dict[str, Any] = {}
        images: list[bytes] = []
        types: list[str] = []
        for name, value in form.multi_items():
            if name in ("images", "image", "images[]"):
                limits.check_counts(len(images) + 1, 0)
                i = len(images)
                if isinstance(value, UploadFile):
                    data = await value.read(settings.api_max_image_bytes + 1)
                else:
                    data = decode_image_string(str(value), i, settings.api_max_image_bytes)
                types.append(check_image_bytes(data, i, settings.api_max_image_bytes))
                images.append(data)
            elif isinstance(value, UploadFile):
                raise bad_request(f"unexpected file part {name!r}", rule="body.form", field=name)
            elif name == "stop":  # one stop string per field (repeat the field for more)
                fields.setdefault("stop", []).append(value)
            elif name in ("token_ids", "metadata"):
                fields[name] = parse_json(value, limits.max_json_depth, where=f"form field {name}")
            else:
                fields[name] = value
        try:
            req = SubmitRequest.model_validate(fields)
        except PydanticValidationError as e:
            raise pydantic_error(e) from None
        _checked(req, limits)
        return _from_model(req, images, types)
    finally:
        await form.close()
