"""What ``/openapi.json`` says beyond the routes' own signatures.

Derived: the request bodies the routes read themselves (:mod:`frontend.api.submit`) come from
their pydantic models, with the bounds their fields declare written from the same
:class:`runtime.request_limits.RequestLimits` the routes check
(:func:`frontend.api.schema_bounds.bounded_schema`), so the documented limits are the
server's, whatever the settings say; the ``multipart/form-data`` body of ``/v1/requests`` is
derived from its JSON body (:func:`frontend.api.protocol.form_schema`). Written here: the
``Idempotency-Key`` header, the error responses and the two query/header bounds no model
holds. The bearer security scheme comes from the routes' tenant dependency
(``frontend.api.deps.bearer``), so Swagger UI can send a token.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from frontend.api.openai_compat.protocol import ChatCompletionRequest, ResponseRequest
from frontend.api.protocol import (
    ERROR_RESPONSES,
    Accepted,
    RequestStatus,
    SubmitRequest,
    VllmGenerateRequest,
    form_schema,
)
from frontend.api.schema_bounds import DocContext, bounded_schema, hoist_defs, json_body
from frontend.api.submit.reading import JSON, MULTIPART
from runtime.request_limits import RequestLimits

STATUS_PATH = "/v1/requests/{request_id}"
WAIT_PARAMS = {(STATUS_PATH, "get", "wait"), ("/v1/requests", "post", "wait")}
"""The ``?wait=`` query parameters, bounded by ``EPD_API_MAX_WAIT_S``."""

IDEMPOTENCY_PARAM: dict[str, Any] = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1},
    "description": "same key + same body: the same request; same key + other body: 409",
}

SUBMIT_BODY = json_body(SubmitRequest)
SUBMIT_BODY["content"][MULTIPART] = {"schema": form_schema(SubmitRequest.model_json_schema())}
VLLM_BODY = json_body(VllmGenerateRequest)

REQUEST_MODELS: dict[str, type[BaseModel]] = {
    m.__name__: m
    for m in (SubmitRequest, VllmGenerateRequest, ChatCompletionRequest, ResponseRequest)
}
"""The models of the bodies the routes read themselves, by their schema's title."""


def with_errors(responses: dict[int | str, dict[str, Any]]) -> dict[int | str, dict[str, Any]]:
    """``responses`` plus the error responses every route may give."""
    return {**responses, **ERROR_RESPONSES}


SUBMIT_RESPONSES = with_errors(
    {200: {"model": Accepted, "description": "seen before (Idempotency-Key)"}}
)


def submit_operation(body: dict[str, Any], *, waits: bool = False) -> dict[str, Any]:
    """The route arguments of a submit route that reads ``body`` itself and answers
    ``202 Accepted`` (``200`` for a request found again by its ``Idempotency-Key``).
    ``waits``: the route takes ``?wait=`` and then answers the request's status instead, ``200``
    once it finished within the wait (``202`` while it still runs)."""
    if not waits:
        model: Any = Accepted
        responses = SUBMIT_RESPONSES
    else:
        model = Accepted | RequestStatus
        responses = with_errors(
            {
                200: {
                    "model": Accepted | RequestStatus,
                    "description": "with wait: the request finished within it (its status); "
                    "else seen before (Idempotency-Key)",
                }
            }
        )
    return {
        "status_code": 202,
        "response_model": model,
        "responses": responses,
        "openapi_extra": {"requestBody": body, "parameters": [IDEMPOTENCY_PARAM]},
    }


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
            # The operations share the routes' module constants: bound a copy.
            schema = copy.deepcopy(schema)
            document_limits(schema, limits_of(), model=model)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document_limits(
    schema: dict[str, Any], limits: RequestLimits, *, model: str | None = None
) -> None:
    """Write the limits (and ``model``, the served model's name) into every request body of
    ``schema`` a model of :data:`REQUEST_MODELS` describes, the ``Idempotency-Key`` headers
    and the long-polls' ``wait``."""
    ctx = DocContext(limits, model)
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            content = op.get("requestBody", {}).get("content", {})
            body = content.get(JSON, {})
            request_model = REQUEST_MODELS.get(body.get("schema", {}).get("title"))
            if request_model is not None:
                body["schema"] = _without_nulls(bounded_schema(request_model, ctx))
                if MULTIPART in content:
                    content[MULTIPART]["schema"] = form_schema(body["schema"])
            for param in op.get("parameters", []):
                if param.get("name") == "Idempotency-Key":
                    param["schema"] = {**param["schema"], "maxLength": limits.max_id_chars}
                if (path, method, param.get("name")) in WAIT_PARAMS:
                    param["schema"]["maximum"] = limits.max_wait_s
    hoist_defs(schema)


def _without_nulls(node: Any) -> Any:
    """``node`` without the keywords whose value is null (``"default": null``), as FastAPI
    writes the rest of the document."""
    if isinstance(node, dict):
        return {k: _without_nulls(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [_without_nulls(v) for v in node]
    return node
