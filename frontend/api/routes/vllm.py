"""``/v1/vllm/generate``: a vLLM render response / ``GenerateRequest``, validated and fanned out
(:mod:`frontend.api.submit.vllm`)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from frontend.api.deps import State, Tenant
from frontend.api.openapi import VLLM_BODY, submit_operation
from frontend.api.submit import accepted_response, submit_body
from frontend.api.submit.vllm import VllmDoor

router = APIRouter(prefix="/v1/vllm", tags=["vllm"])


@router.post(
    "/generate",
    **submit_operation(VLLM_BODY),
    summary="Fan out a vLLM render response / GenerateRequest (full encoder inputs)",
)
async def vllm_generate(request: Request, st: State, tenant: Tenant) -> JSONResponse:
    # The body's bytes stay reserved until its tensors are fanned out.
    return accepted_response((await submit_body(request, st, tenant, VllmDoor(st))).accepted)
