"""API errors: one JSON shape, ``{"error": {"code", "message", "rule"?, "field"?, "item"?}}``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError as PydanticValidationError

from producers.refusal import Refused
from runtime.request_limits import SIZE_RULES
from schemas.errors import ValidationError

# Renderer rules that mean "too big" rather than "invalid": the client must send less.
TOO_LARGE_RULES = frozenset(
    {
        "render.image_too_large",
        "render.image_too_complex",
        "render.too_many_images",
        "render.too_many_videos",
        "render.video_too_large",
        "render.video_too_complex",
        "render.video_too_long",
        "render.video_too_many_frames",
        "render.video_decode_budget",
        "image_url.size",
        "image_url.total",
        *SIZE_RULES,
    }
)
UNSUPPORTED_RULES = frozenset({"image_url.type"})
"""Rules that mean "a type this server does not take" (415)."""
TIMEOUT_RULE = "render.timeout"
"""A render that ran past EPD_API_RENDER_TIMEOUT_S: 503, the server gave up on it."""


class ApiError(Exception):
    """An answer other than success; raised anywhere in a handler, rendered by one handler."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        rule: str | None = None,
        field: str | None = None,
        item: int | None = None,
        modality: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.rule = rule
        self.field = field
        self.item = item
        self.modality = modality
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        for name in ("rule", "field", "item", "modality"):
            value = getattr(self, name)
            if value is not None:
                err[name] = value
        return {"error": err}


def from_validation(exc: ValidationError) -> ApiError:
    """A renderer or validator rejection as an API error (413 for size rules, 415 for types,
    503 for a render timeout, else 422)."""
    if exc.rule == TIMEOUT_RULE:
        return ApiError(
            503,
            "timeout",
            exc.detail,
            rule=exc.rule,
            field=exc.field,
            item=exc.item,
            modality=exc.modality,
        )
    too_large = exc.rule in TOO_LARGE_RULES
    status, code = (413, "too_large") if too_large else (422, "validation_failed")
    if exc.rule in UNSUPPORTED_RULES:
        status, code = 415, "unsupported_media_type"
    return ApiError(
        status,
        code,
        exc.detail,
        rule=exc.rule,
        field=exc.field,
        item=exc.item,
        modality=exc.modality,
    )


def bad_request(message: str, *, rule: str, field: str | None = None, item: int | None = None):
    """400: the request cannot be parsed."""
    return ApiError(400, "malformed", message, rule=rule, field=field, item=item)


def throttled(message: str, retry_after_s: int, *, rule: str) -> ApiError:
    """429 with ``Retry-After``."""
    return ApiError(
        429, "throttled", message, rule=rule, headers={"Retry-After": str(retry_after_s)}
    )


def unavailable(message: str, retry_after_s: int, *, rule: str) -> ApiError:
    """503 with ``Retry-After``: a dependency (Kafka, Redis) is down."""
    return ApiError(
        503, "unavailable", message, rule=rule, headers={"Retry-After": str(retry_after_s)}
    )


def not_found(request_id: str, *, what: str = "request", field: str = "request_id") -> ApiError:
    """404 naming the thing looked up (a request, or a response of the OpenAI routes)."""
    return ApiError(404, "not_found", f"no {what} {request_id!r}", field=field)


REFUSAL_STATUS = {"malformed": 400, "conflict": 409, "throttled": 429, "unavailable": 503}
REFUSAL_CODE = {
    "malformed": "malformed",
    "conflict": "conflict",
    "throttled": "throttled",
    "unavailable": "unavailable",
}


def from_refusal(exc: Refused) -> ApiError:
    """An intake refusal as an API error (``Retry-After`` where the intake gave one)."""
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s is not None else {}
    return ApiError(
        REFUSAL_STATUS[exc.kind],
        exc.code or REFUSAL_CODE[exc.kind],
        exc.message,
        rule=exc.rule,
        field=exc.field,
        headers=headers,
    )


@contextmanager
def answered() -> Iterator[None]:
    """A rule's ``ValidationError`` raised inside as the API error it is answered with."""
    try:
        yield
    except ValidationError as e:
        raise from_validation(e) from None


def pydantic_error(exc: PydanticValidationError | Any, *, prefix: str = "") -> ApiError:
    """The first error of a pydantic (or FastAPI request) validation as a 422 naming the field
    and, for a list element, its index."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": str(exc)}
    loc = [str(x) for x in first.get("loc", ())]
    if loc[:1] in (["body"], ["query"], ["header"], ["path"]) and len(loc) > 1:
        loc = loc[1:]  # FastAPI prefixes where the value came from
    item = next((int(x) for x in loc[1:] if x.isdigit()), None)
    where = ".".join([prefix, *loc] if prefix else loc) or "body"
    return ApiError(
        422,
        "validation_failed",
        f"{where}: {first.get('msg', 'invalid')}",
        rule="request.schema",
        field=(f"{prefix}.{loc[0]}" if prefix and loc else (loc[0] if loc else prefix or None)),
        item=item,
    )
