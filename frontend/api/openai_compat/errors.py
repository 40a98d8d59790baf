"""OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, for the
OpenAI-compatible routes, with the native API's status codes.

Every error of those routes is an :class:`frontend.api.errors.ApiError` first (raised there
or translated from a refusal or a rule, exactly as on the native routes), then written in this
shape: ``code`` is the rule it broke (``max-tokens``, ``image_url.host``...) or, without one,
the native code; ``param`` the field (with the item index where there is one); ``type``
OpenAI's class of the status.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError as PydanticValidationError

from frontend.api.errors import ApiError

OPENAI_PREFIXES = ("/v1/chat/", "/v1/responses", "/v1/models", "/v1/completions")
"""Paths whose errors are written in OpenAI's shape."""

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def is_openai_path(path: str) -> bool:
    """Whether ``path`` belongs to the OpenAI-compatible routes."""
    return path.startswith(OPENAI_PREFIXES) or path.rstrip("/") in ("/v1/models", "/v1/responses")


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def openai_body(exc: ApiError) -> dict[str, Any]:
    """``exc`` in OpenAI's shape."""
    param = exc.field
    if param is not None and exc.item is not None and "[" not in param:
        param = f"{param}[{exc.item}]"
    return {
        "error": {
            "message": exc.message,
            "type": error_type(exc.status),
            "param": param,
            "code": exc.rule or exc.code,
        }
    }


def _path(loc: tuple[Any, ...]) -> str:
    """A pydantic location as OpenAI writes a parameter: ``messages[0].content[1].text``
    (without the names pydantic gives a union's members, or a tagged union's tag)."""
    out = ""
    tag_next = False
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        if "[" in text or text in ("str", "list", "dict", "int", "float", "bool"):
            tag_next = "tagged-union" in text
            continue
        if tag_next:  # the tag (a part's "type") stands between the index and the field
            tag_next = False
            continue
        out += f".{text}" if out else text
    return out


def schema_error(exc: PydanticValidationError) -> ApiError:
    """A body that does not fit the request model: 422 ``request.schema`` naming the most
    specific failure (a union's deepest branch, not "should be a string")."""
    errors = exc.errors()
    first = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {"loc": (), "msg": ""}
    where = _path(tuple(first.get("loc", ()))) or "body"
    msg = str(first.get("msg", "invalid"))
    if first.get("type") == "extra_forbidden":
        msg = "unknown parameter (not part of this API)"
    return ApiError(422, "validation_failed", f"{where}: {msg}", rule="request.schema", field=where)
