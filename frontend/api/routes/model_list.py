"""``/v1/models``: the model the workers serve, as OpenAI lists models."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from frontend.api.deps import State, Tenant
from frontend.api.errors import ApiError
from frontend.api.openai_compat.openapi import with_openai_errors
from frontend.api.openai_compat.protocol import ModelCard, ModelList
from frontend.api.state import ApiState

router = APIRouter(prefix="/v1", tags=["openai"])

OWNER = "epd-pipeline"


def model_card(st: ApiState) -> dict[str, Any]:
    return {
        "id": st.settings.model_name(),
        "object": "model",
        "created": int(st.started_s),
        "owned_by": OWNER,
        "max_model_len": st.limits.context_tokens,
    }


@router.get(
    "/models",
    responses=with_openai_errors({200: {"model": ModelList}}),
    summary="The served model (the name requests give as `model`)",
)
async def list_models(st: State, _: Tenant) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [model_card(st)]})


@router.get(
    "/models/{model:path}",
    responses=with_openai_errors({200: {"model": ModelCard}}),
    summary="One model (404 for any but the served one)",
)
async def get_model(model: str, st: State, _: Tenant) -> JSONResponse:
    if model != st.settings.model_name():
        raise ApiError(
            404,
            "not_found",
            f"the model {model!r} does not exist",
            rule="model_not_found",
            field="model",
        )
    return JSONResponse(model_card(st))
