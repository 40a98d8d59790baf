"""What ``/openapi.json`` says beyond the routes' own signatures: request bodies the routes
parse themselves (JSON or multipart, read and counted by ``read_body``), the
``Idempotency-Key`` header, and the error responses."""

from __future__ import annotations

from typing import Any

from producers.api.models import ERROR_RESPONSES, Accepted, SubmitRequest

IDEMPOTENCY_PARAM: dict[str, Any] = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "maxLength": 255},
    "description": "same key + same body: the same request; same key + other body: 409",
}

SUBMIT_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": SubmitRequest.model_json_schema(),
            "example": SubmitRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
        },
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "prompt": {"type": "string"},
                    "token_ids": {"type": "string", "description": "JSON list"},
                    "images": {
                        "type": "array",
                        "items": {"type": "string", "format": "binary"},
                    },
                    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 4096},
                    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                    "ignore_eos": {"type": "boolean"},
                    "cache_salt": {"type": "string"},
                    "deadline_s": {"type": "number"},
                    "metadata": {"type": "string", "description": "JSON object"},
                },
            }
        },
    },
}

VLLM_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "description": "a vLLM render response or GenerateRequest",
                "required": ["token_ids", "features"],
                "properties": {
                    "token_ids": {"type": "array", "items": {"type": "integer"}},
                    "features": {"type": "object"},
                    "sampling_params": {"type": "object"},
                },
            }
        }
    },
}


def with_errors(responses: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """``responses`` plus the error responses every route may give."""
    return {**responses, **ERROR_RESPONSES}


SUBMIT_RESPONSES = with_errors(
    {200: {"model": Accepted, "description": "seen before (Idempotency-Key)"}}
)
