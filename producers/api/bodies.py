"""Reading and parsing request bodies: size limits first, then structure, then image bytes.

Order matters for safety: the body is counted while it is read (a 50 MB upload is refused at
the limit, never held whole), within its deadline, and its bytes are reserved from the
process's body budget before they are held (:class:`BodyRules`); a text far over its limit
is refused from the raw bytes before the parse (:func:`refuse_long_text`); an image's
encoded size is checked before it is base64-decoded; its type is sniffed from magic bytes
before any decoder sees it; pixel counts are checked by the renderer from the header before
pixels are decompressed. Image strings are data only: base64 or ``data:`` URLs. Nothing here
opens a file or fetches a URL.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from producers.api.budget import ByteBudget, Reservation
from producers.api.checks import pydantic_error
from producers.api.data_strings import check_image_bytes, decode_image_string
from producers.api.errors import ApiError, answered, bad_request
from producers.api.models import SubmitRequest
from producers.api.videos import decode_videos
from producers.image_structure import StructureLimits
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


SMALL_BODY_BYTES = 64 * 1024
"""Bodies up to this size reserve nothing from the body budget: they cost little, and small
requests keep working while big ones have spent it."""


@dataclass(frozen=True, slots=True)
class BodyRules:
    """How the API reads a body: at most ``max_bytes``, all of it within ``timeout_s``, its
    bytes reserved from the process's ``budget`` while they are held (see
    :mod:`producers.api.budget`)."""

    max_bytes: int
    timeout_s: float
    budget: ByteBudget
    retry_after_s: int = 1
    parsing: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    """Big bodies parse one at a time: JSON, base64 and pydantic hold the GIL (threads run
    them no faster side by side), and each parse waiting for it is one the event loop, and so
    ``/healthz``, would wait behind."""

    @classmethod
    def from_settings(cls, settings: Any) -> BodyRules:
        """The rules of ``EPD_API_MAX_BODY_BYTES``, ``EPD_API_BODY_TIMEOUT_S`` and
        ``EPD_API_BODY_BUDGET_BYTES`` (never below the largest body, which must fit alone)."""
        budget = max(settings.api_body_budget_bytes, settings.api_max_body_bytes)
        return cls(
            settings.api_max_body_bytes,
            settings.api_body_timeout_s,
            ByteBudget(budget),
            settings.api_retry_after_s,
        )

    @asynccontextmanager
    async def held(self, request: Request) -> AsyncIterator[bytes]:
        """The body, read under these rules; its bytes stay reserved until the block ends
        (put the parse and the render that hold them inside it)."""
        hold = Reservation(self.budget)
        try:
            yield await read_body(
                request,
                self.max_bytes,
                hold=hold,
                timeout_s=self.timeout_s,
                retry_after_s=self.retry_after_s,
            )
        finally:
            hold.release()


async def read_body(
    request: Request,
    limit: int,
    *,
    hold: Reservation | None = None,
    timeout_s: float | None = None,
    retry_after_s: int = 1,
) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes, 408 when
    it has not all arrived within ``timeout_s``, 503 when ``hold`` cannot cover it (its
    declared length before a byte is read, else as it grows past :data:`SMALL_BODY_BYTES`).
    None of them reads the rest of the body (the server discards it); 408 closes the
    connection."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise bad_request("Content-Length is not a number", rule="body.length")
        if int(declared) > limit:
            raise _body_too_large(int(declared), limit)
        _reserve(hold, int(declared), retry_after_s)
    chunks: list[bytes] = []
    total = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise _body_too_large(total, limit)
                _reserve(hold, total, retry_after_s)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408,
            "timeout",
            f"the body did not arrive within {timeout_s:g} s ({total} bytes came; "
            "EPD_API_BODY_TIMEOUT_S)",
            rule="body.timeout",
            headers=dict(CLOSE),
        ) from None
    return b"".join(chunks)


CLOSE = {"Connection": "close"}
"""On the answer to a body too slow to wait for: the server closes the connection instead of
reading (and discarding) the rest. Refusals of a client that sends at speed (413, 503) keep
it: the server discards what it did not read (no memory; closed after the keep-alive
timeout at most), so the client reads the answer instead of a reset connection."""


def _reserve(hold: Reservation | None, size: int, retry_after_s: int) -> None:
    """``hold`` covers a body of ``size`` bytes (small ones need nothing), else 503."""
    if hold is None or size <= SMALL_BODY_BYTES or hold.cover(size):
        return
    budget = hold.budget
    raise ApiError(
        503,
        "unavailable",
        f"this server is holding {budget.used} bytes of other request bodies and has room "
        f"for {budget.free} more; this body needs {size} (EPD_API_BODY_BUDGET_BYTES is "
        f"{budget.total}); retry later",
        rule="body.budget",
        headers={"Retry-After": str(retry_after_s)},
    )


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
        413,
        "too_large",
        f"body is at least {size} bytes; the limit is {limit}",
        rule="body.size",
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
    problem = _tree_problem(obj, max_depth, strings=_may_hold_surrogate(body))
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


BYTES_PER_CHAR = 12
"""The most bytes one character of a JSON string can take (a surrogate pair written as two
``\\u`` escapes): a string of more bytes than this many times a limit holds more characters
than the limit, whatever it is made of."""
_WINDOWS = 4
"""Quote-free windows per over-long string length :func:`refuse_long_text` looks through."""


def refuse_long_text(body: bytes, keys: tuple[str, ...], max_chars: int) -> None:
    """413 ``request.prompt`` for a text field (a string value of one of ``keys``) that holds
    more than ``max_chars`` characters for certain, found in the raw bytes before anything is
    parsed: parsing a 30 MB body holds the GIL (so the event loop) for most of a second, only
    for the prompt's limit to refuse it afterwards.

    A string of more than ``BYTES_PER_CHAR * max_chars`` bytes has no quote in that span: the
    body is looked through in windows a quarter that long (a few ``bytes.find`` calls, never a
    Python loop over its bytes); a quote-free window's run is taken back to the quote that
    opened it, and refused when that quote opens the value of a text key written plainly
    (``{"prompt": "`` / ``, "content": "``: a key's quote after ``{``, ``,`` or a space is
    outside every string). Shorter texts, or keys written with escapes, are left to the
    parse, which holds every text to the exact limit."""
    span = BYTES_PER_CHAR * max_chars
    step = max(1, span // _WINDOWS)
    at = 0
    while at + step <= len(body):
        if body.find(b'"', at, at + step) != -1:
            at += step
            continue
        opened = body.rfind(b'"', 0, at)
        closed = body.find(b'"', at + step)
        end = len(body) if closed == -1 else closed
        if opened != -1 and end - opened - 1 > span:
            key = _text_key(body[max(0, opened - 64) : opened + 1], keys)
            if key is not None:
                raise ValidationError(
                    "request.prompt",
                    f"{key!r} holds a string of {end - opened - 1} bytes or more: more than "
                    f"{max_chars} characters (EPD_API_MAX_PROMPT_CHARS)",
                    field=key,
                )
        if closed == -1:
            return
        at = closed + 1


_KEYED_STRING = re.compile(rb'[{,\s]"([A-Za-z_]{1,32})"\s*:\s*"\Z')
"""A plainly written key, its colon and the quote that opens its string value, at the end of
the bytes before a long string."""


def _text_key(before: bytes, keys: tuple[str, ...]) -> str | None:
    """The key whose string value opens at the end of ``before``, when it is one of ``keys``."""
    match = _KEYED_STRING.search(before)
    if match is None:
        return None
    key = match.group(1).decode()
    return key if key in keys else None


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point: json.loads joins a well-formed escaped pair into one character, so
any left in a parsed string is half a pair."""


ESCAPES_SCANNED = 256
"""``\\u`` escapes :func:`_may_hold_surrogate` looks at before it leaves the question to the
scan of the parsed strings."""


def _may_hold_surrogate(body: bytes | str) -> bool:
    """Whether the JSON text can hold a lone surrogate, by a scan of its bytes far cheaper
    than a regex over every parsed string (which held the GIL for most of a second per 30 MB
    body): UTF-8 text holds one only as a ``\\uD800``-``\\uDFFF`` escape or as raw
    ``ED A0``-``ED BF`` bytes (``json.loads`` decodes with ``surrogatepass``). Other
    encodings, text already decoded, and many escapes: True (the strings are scanned)."""
    if not isinstance(body, bytes) or not json.detect_encoding(body).startswith("utf-8"):
        return True
    for marker, follows in ((b"\\u", b"dD"), (b"\xed", None)):
        at, seen = body.find(marker), 0
        while at != -1:
            nxt = body[at + len(marker) : at + len(marker) + 2]
            if follows is None:
                if nxt[:1] and 0xA0 <= nxt[0] <= 0xBF:
                    return True
            elif nxt[:1] and nxt[:1] in follows and nxt[1:2] and nxt[1:2] in b"89abcdefABCDEF":
                return True
            seen += 1
            if seen > ESCAPES_SCANNED:
                return True
            at = body.find(marker, at + 1)
    return False


def _tree_problem(obj: Any, limit: int, *, strings: bool = True) -> str | None:
    """``"depth"`` when objects/arrays nest more than ``limit`` levels, ``"surrogate"`` when a
    string or key holds a lone surrogate (looked for only when ``strings``), else None
    (iterative: no recursion)."""
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if strings and _SURROGATE.search(node):
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
    refuse_long_text(body, ("prompt",), limits.max_prompt_chars)
    obj = parse_json(body, limits.max_json_depth)
    if not isinstance(obj, dict):
        raise bad_request("body must be a JSON object", rule="body.json")
    # Counted before pydantic copies megabytes of image strings around.
    images, videos = obj.get("images"), obj.get("videos")
    limits.check_counts(
        len(images) if isinstance(images, list) else 0,
        len(videos) if isinstance(videos, list) else 0,
    )
    if isinstance(obj.get("prompt"), str):  # a 30 MB prompt: refused before pydantic sees it
        limits.check_prompt(obj["prompt"], None)
    try:
        req = SubmitRequest.model_validate(obj)
    except PydanticValidationError as e:
        raise pydantic_error(e) from None
    _checked(req, limits)
    datas, types = [], []
    structure = StructureLimits.from_settings(settings)
    for i, text in enumerate(req.images):
        data = decode_image_string(text, i, settings.api_max_image_bytes)
        types.append(check_image_bytes(data, i, settings.api_max_image_bytes, structure))
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
                types.append(
                    check_image_bytes(
                        data,
                        i,
                        settings.api_max_image_bytes,
                        StructureLimits.from_settings(settings),
                    )
                )
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
