"""Checks every route shares, written once: the content type, the "already finished" refusal,
and pydantic's errors as one 422 shape."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError as PydanticValidationError
from starlette.requests import Request

from producers.api.errors import ApiError
from schemas.status_record import StatusRecord

JSON = "application/json"
MULTIPART = "multipart/form-data"


def content_type(request: Request, *accepted: str) -> str:
    """The request's media type (lower case, no parameters) when it is one of ``accepted``;
    415 ``body.content_type`` otherwise."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in accepted:
        raise ApiError(
            415,
            "unsupported_media_type",
            f"send {' or '.join(accepted)}",
            rule="body.content_type",
        )
    return ctype


def refuse_finished(rec: StatusRecord) -> None:
    """409 ``cancel.terminal`` for a request that already has an outcome other than
    ``cancelled`` (cancelling a cancelled request answers its status again)."""
    if rec.terminal and rec.status != "cancelled":
        raise ApiError(
            409,
            "already_finished",
            f"request is already {rec.status}",
            rule="cancel.terminal",
        )


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
