"""What ``/openapi.json`` says of the OpenAI-compatible routes: their bodies (parsed by the
routes themselves; derived from the request models, bounds included, by
:mod:`frontend.api.openapi`), answers (JSON, or server-sent chunks) and OpenAI-shaped
errors."""

from __future__ import annotations

from typing import Any

from frontend.api.openai_compat.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    OpenAIError,
    ResponseObject,
    ResponseRequest,
)
from frontend.api.schema_bounds import REF_TEMPLATE, json_body

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


CHAT_BODY = json_body(ChatCompletionRequest)
RESPONSE_BODY = json_body(ResponseRequest)

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
                            ref_template=REF_TEMPLATE
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
