"""What ``/openapi.json`` says beyond the routes' own signatures.

Request bodies the routes parse themselves (JSON or multipart, read and counted by
``read_body``), the ``Idempotency-Key`` header and the error responses, and every bound written
from the same :class:`runtime.request_limits.RequestLimits` the routes check: the documented
limits are the server's, whatever the settings say. The bearer security scheme comes from the
routes' tenant dependency (``producers.api.deps.bearer``), so Swagger UI can send a token.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from producers.api.models import ERROR_RESPONSES, Accepted, SubmitRequest
from producers.api.openai_compat.openapi import document_openai_limits, hoist_defs
from producers.api.schema_bounds import bound, sampling_bounds
from runtime.request_limits import RequestLimits

SUBMIT_PATH = "/v1/requests"
VLLM_PATH = "/v1/vllm/generate"
STATUS_PATH = "/v1/requests/{request_id}"

IDEMPOTENCY_PARAM: dict[str, Any] = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1},
    "description": "same key + same body: the same request; same key + other body: 409",
}

_MULTIPART_FIELDS: dict[str, Any] = {
    "prompt": {"type": "string"},
    "token_ids": {"type": "string", "description": "JSON list of token ids"},
    "images": {"type": "array", "items": {"type": "string", "format": "binary"}},
    "max_tokens": {"type": "integer"},
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "top_k": {"type": "integer"},
    "seed": {"type": "integer"},
    "stop": {"type": "array", "items": {"type": "string"}, "description": "repeat per string"},
    "ignore_eos": {"type": "boolean"},
    "cache_salt": {"type": "string"},
    "deadline_s": {"type": "number"},
    "metadata": {"type": "string", "description": "JSON object of string labels"},
}

SUBMIT_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": SubmitRequest.model_json_schema(),
            "example": SubmitRequest.model_config["json_schema_extra"]["examples"][0],  # type: ignore[index]
        },
        "multipart/form-data": {"schema": {"type": "object", "properties": _MULTIPART_FIELDS}},
    },
}

VLLM_BODY: dict[str, Any] = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "description": "a vLLM render response or GenerateRequest; every item brings "
                "its kwargs_data (the fan-out signs the embedding entries)",
                "required": ["token_ids", "features"],
                "properties": {
                    "request_id": {"type": "string"},
                    "token_ids": {"type": "array", "items": {"type": "integer"}},
                    "features": {
                        "type": "object",
                        "properties": {
                            "mm_hashes": {"type": "object"},
                            "mm_placeholders": {"type": "object"},
                            "kwargs_data": {"type": ["object", "null"]},
                            "mm_metadata": {"type": ["object", "null"]},
                        },
                    },
                    "sampling_params": {
                        "type": "object",
                        "description": "vLLM's SamplingParams (its defaults: temperature 1, "
                        "max_tokens 16); fields that would change the tokens and are not "
                        "supported (n > 1, penalties, logprobs...) are refused",
                        "properties": {
                            "max_tokens": {"type": "integer"},
                            "temperature": {"type": "number"},
                            "top_p": {"type": "number"},
                            "top_k": {"type": "integer"},
                            "seed": {"type": ["integer", "null"]},
                            "stop": {
                                "anyOf": [
                                    {"type": "string"},
                                    {"type": "array", "items": {"type": "string"}},
                                ]
                            },
                            "stop_token_ids": {"type": "array", "items": {"type": "integer"}},
                            "ignore_eos": {"type": "boolean"},
                        },
                    },
                    "cache_salt": {"type": ["string", "null"]},
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


def install_openapi(app: FastAPI, limits_of: Any, model: str | None = None) -> None:
    """Serve ``/openapi.json`` with the bounds of ``limits_of()`` written in (made once);
    ``model``: the served model's name, the one ``model`` the OpenAI routes take."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            document_limits(schema, limits_of(), model=model)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document_limits(
    schema: dict[str, Any], limits: RequestLimits, *, model: str | None = None
) -> None:
    """Write the limits into the submit, vLLM, status and OpenAI-compatible operations of
    ``schema`` (``model``: the served model's name)."""
    hoist_defs(schema)
    document_openai_limits(schema, limits, model=model)
    paths = schema.get("paths", {})
    submit = paths.get(SUBMIT_PATH, {}).get("post")
    if submit is not None:
        content = submit["requestBody"]["content"]
        body = content["application/json"]["schema"] = copy.deepcopy(
            content["application/json"]["schema"]
        )
        _submit_bounds(body["properties"], limits)
        form = content["multipart/form-data"]["schema"] = copy.deepcopy(
            content["multipart/form-data"]["schema"]
        )
        _submit_bounds(form["properties"], limits, form=True)
    vllm = paths.get(VLLM_PATH, {}).get("post")
    if vllm is not None:
        body = vllm["requestBody"]["content"]["application/json"]["schema"] = copy.deepcopy(
            vllm["requestBody"]["content"]["application/json"]["schema"]
        )
        _vllm_bounds(body["properties"], limits)
    for op in (submit, vllm):
        for param in (op or {}).get("parameters", []):
            if param.get("name") == "Idempotency-Key":
                param["schema"] = {**param["schema"], "maxLength": limits.max_id_chars}
    status = paths.get(STATUS_PATH, {}).get("get")
    for param in (status or {}).get("parameters", []):
        if param.get("name") == "wait":
            bound(param["schema"], maximum=limits.max_wait_s)


def _submit_bounds(props: dict[str, Any], limits: RequestLimits, *, form: bool = False) -> None:
    bound(props["prompt"], maxLength=limits.max_prompt_chars)
    if not form:
        bound(
            props["token_ids"],
            maxItems=limits.context_tokens - 1,
            items={"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1},
        )
        bound(props["videos"], maxItems=limits.max_videos)
        bound(
            props["metadata"],
            maxProperties=limits.max_metadata_keys,
            propertyNames={"maxLength": limits.max_metadata_chars},
            additionalProperties={"type": "string", "maxLength": limits.max_metadata_chars},
            description=f"opaque labels returned with the status; keys and values together at "
            f"most {limits.max_metadata_bytes} bytes (UTF-8)",
        )
    bound(props["images"], maxItems=limits.max_images)
    sampling_bounds(props, limits, stop_form=form)
    bound(props["cache_salt"], maxLength=limits.max_cache_salt_chars)
    bound(props["deadline_s"], exclusiveMinimum=0, maximum=limits.max_deadline_s)


def _vllm_bounds(props: dict[str, Any], limits: RequestLimits) -> None:
    bound(props["request_id"], minLength=1, maxLength=limits.max_id_chars)
    bound(
        props["token_ids"],
        minItems=1,
        maxItems=limits.context_tokens - 1,
        items={"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1},
    )
    bound(props["cache_salt"], maxLength=limits.max_cache_salt_chars)
    sampling = props["sampling_params"]["properties"]
    sampling_bounds(sampling, limits)
    bound(
        sampling["stop_token_ids"],
        items={"type": "integer", "minimum": 0, "maximum": limits.vocab_size - 1},
    )
