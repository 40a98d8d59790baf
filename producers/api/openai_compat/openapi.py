"""What ``/openapi.json`` says of the OpenAI-compatible routes: their bodies (parsed by the
routes themselves), answers (JSON, or server-sent chunks), OpenAI-shaped errors, and the
bounds of :class:`runtime.request_limits.RequestLimits` written into the request schemas."""

from __future__ import annotations

import copy
from typing import Any

from producers.api.openai_compat.models import (
    NEUTRAL,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    OpenAIError,
    ResponseObject,
    ResponseRequest,
)
from producers.api.schema_bounds import bound, sampling_bounds
from runtime.request_limits import RequestLimits

CHAT_PATH = "/v1/chat/completions"
RESPONSES_PATH = "/v1/responses"

OPENAI_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": OpenAIError, "description": desc}
    for code, desc in {
        400: "malformed request (bad JSON, bad base64, a URL not allowed)",
        401: "missing or unknown bearer token (when EPD_API_TOKENS is set)",
        404: "unknown model or response id (or another tenant's)",
        409: "Idempotency-Key reused with another body, or cancel of a finished response",
        413: "body, image or message count too large",
        415: "unsupported content or image type",
        422: "validation failed (`code` names the rule)",
        429: "too many requests in flight; see Retry-After",
        503: "Kafka or Redis unavailable, or the request failed; see Retry-After",
    }.items()
}


def with_openai_errors(
    responses: dict[int | str, dict[str, Any]],
) -> dict[int | str, dict[str, Any]]:
    """``responses`` plus the OpenAI-shaped error responses every OpenAI route may give."""
    return {**responses, **OPENAI_ERRORS}


IDEMPOTENCY_NOTE = (
    " An `Idempotency-Key` header makes a retry find the same request (and a client that goes "
    "away does not cancel it)."
)


def _body(model: Any) -> dict[str, Any]:
    return {
        "required": True,
        "content": {
            "application/json": {
                "schema": model.model_json_schema(ref_template="#/components/schemas/{model}"),
                "example": model.model_config["json_schema_extra"]["examples"][0],
            }
        },
    }


CHAT_BODY = _body(ChatCompletionRequest)
RESPONSE_BODY = _body(ResponseRequest)

CHAT_RESPONSES = with_openai_errors(
    {
        200: {
            "model": ChatCompletion,
            "description": "the completion; with `stream`, `text/event-stream`: one "
            "`chat.completion.chunk` per `data:` event, then `data: [DONE]`." + IDEMPOTENCY_NOTE,
            "content": {
                "text/event-stream": {
                    "schema": {
                        "type": "string",
                        "description": "data: <chat.completion.chunk JSON> events",
                        "contentSchema": ChatCompletionChunk.model_json_schema(
                            ref_template="#/components/schemas/{model}"
                        ),
                    }
                }
            },
        }
    }
)
RESPONSE_RESPONSES = with_openai_errors(
    {
        200: {
            "model": ResponseObject,
            "description": "with `background`: the response, `queued`, at once; else the "
            "finished response." + IDEMPOTENCY_NOTE,
        }
    }
)


def document_openai_limits(
    schema: dict[str, Any], limits: RequestLimits, *, model: str | None = None
) -> None:
    """Write the limits (and ``model``, the served model's name) into the chat and responses
    request bodies of ``schema``."""
    paths = schema.get("paths", {})
    for path, tokens, items, free in (
        (CHAT_PATH, ("max_tokens", "max_completion_tokens"), "messages", {"stream"}),
        (RESPONSES_PATH, ("max_output_tokens",), "input", set()),
    ):
        op = paths.get(path, {}).get("post")
        if op is None:
            continue
        content = op["requestBody"]["content"]["application/json"]
        body = content["schema"] = copy.deepcopy(content["schema"])
        props = body["properties"]
        sampling_bounds(props, limits, max_tokens=tokens)
        if model is not None:
            bound(props["model"], enum=[model])
        for branch in props[items].get("anyOf", [props[items]]):
            if branch.get("type") == "array":
                branch["maxItems"] = limits.max_messages
        bound(props["cache_salt"], maxLength=limits.max_cache_salt_chars)
        bound(
            props["metadata"],
            maxProperties=limits.max_metadata_keys,
            propertyNames={"maxLength": limits.max_metadata_chars},
            additionalProperties={"type": "string", "maxLength": limits.max_metadata_chars},
        )
        for name, neutral in NEUTRAL.items():
            if name in props and name not in free:  # documented: the neutral values only
                props[name] = {
                    "enum": list(neutral),
                    "description": "accepted at its neutral value only (not supported)",
                }
        if "stop_token_ids" in props:
            bound(
                props["stop_token_ids"],
                items={"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1},
            )


def hoist_defs(schema: dict[str, Any]) -> None:
    """Copy the ``$defs`` of schemas written inside operations (request bodies, event-stream
    chunks) into ``components/schemas``, where their ``$ref``s point (copied, not moved: the
    operations' schemas are module constants)."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    stack: list[Any] = [schema.get("paths", {})]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for name, sub in (node.get("$defs") or {}).items():
                if name not in components:
                    components[name] = copy.deepcopy(sub)
            stack.extend(v for k, v in node.items() if k != "$defs")
        elif isinstance(node, list):
            stack.extend(node)
