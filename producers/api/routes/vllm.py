"""``/v1/vllm/generate``: a vLLM render response / ``GenerateRequest``, validated and fanned out."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from producers.api.bodies import parse_json
from producers.api.checks import JSON, content_type
from producers.api.deps import State, Tenant
from producers.api.models import Accepted
from producers.api.openapi import IDEMPOTENCY_PARAM, SUBMIT_RESPONSES, VLLM_BODY
from producers.api.state import ApiState
from producers.api.submissions import SubmitHeaders, accepted_response, off_the_loop
from producers.intake import RenderContext, Submission
from schemas import defaults
from schemas.errors import ValidationError
from schemas.types import RenderEvent, SamplingParams
from schemas.vllm_sampling import sampling_from_vllm

router = APIRouter(prefix="/v1/vllm", tags=["vllm"])


@router.post(
    "/generate",
    status_code=202,
    response_model=Accepted,
    responses=SUBMIT_RESPONSES,
    openapi_extra={"requestBody": VLLM_BODY, "parameters": [IDEMPOTENCY_PARAM]},
    summary="Fan out a vLLM render response / GenerateRequest (full encoder inputs)",
)
async def vllm_generate(request: Request, st: State, tenant: Tenant) -> JSONResponse:
    content_type(request, JSON)
    # The body's bytes stay reserved until its tensors are fanned out.
    async with st.bodies.held(request) as body:
        return await _generate(request, st, tenant, body)


async def _generate(
    request: Request, st: ApiState, tenant: str | None, body: bytes
) -> JSONResponse:
    slot = st.bodies.parsing
    obj = await off_the_loop(len(body), parse_json, body, st.limits.max_json_depth, slot=slot)
    sampling = door_checks(st, obj)
    # Base64 + msgpack decoding of megabytes of tensors: off the event loop.
    req = await off_the_loop(len(body), parse_render, st, obj, slot=slot)
    vllm_id = None if obj.get("request_id") is None else str(obj["request_id"])

    async def render(ctx: RenderContext) -> RenderEvent:
        return RenderEvent(
            request_id=ctx.request_id,
            model=st.renderer.info.model_name,
            token_ids=list(req.token_ids),
            features=req.features,
            sampling=ctx.sampling,
            cache_salt=ctx.cache_salt,
            trace={"vllm_request_id": vllm_id} if vllm_id else {},
        )

    headers = SubmitHeaders.of(request)
    sub = Submission(
        render=render,
        sampling=sampling,
        tenant=tenant,
        cache_salt=obj.get("cache_salt"),
        metadata={"vllm_request_id": vllm_id} if vllm_id else None,
        foreign_labels=True,
        traceparent=headers.traceparent,
        idempotency_key=headers.idempotency_key,
        fingerprint=await off_the_loop(len(body), fingerprint, obj, slot=slot),
        decodes_media=False,  # its tensors come decoded: nothing for a render slot to bound
        door_checked=True,  # door_checks: sampling_params and the items counted
    )
    return accepted_response(await st.intake.submit(sub))


def door_checks(st: ApiState, obj: Any) -> SamplingParams:
    """What the request limits say of the body's own fields, before its tensors are decoded:
    the same limits ``/v1/requests`` is held to (the intake checks the rendered request)."""
    if not isinstance(obj, dict):
        raise ValidationError("request.schema", "the body must be a JSON object")
    st.limits.check_id(obj.get("request_id"), "request_id")
    st.limits.check_cache_salt(obj.get("cache_salt"))
    features = obj.get("features")
    hashes = features.get("mm_hashes") if isinstance(features, dict) else None
    if isinstance(hashes, dict):  # counted before any item is decoded
        st.limits.check_counts(
            *(len(h) if isinstance(h, list) else 0 for h in map(hashes.get, ("image", "video")))
        )
    sp = obj.get("sampling_params")
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise ValidationError(
            "request.schema", "sampling_params must be an object", field="sampling_params"
        )
    # vLLM's meaning of each field (its defaults where one is absent: a temperature of 1),
    # then the bounds every route holds sampling to.
    st.limits.check_max_tokens(
        sp.get("max_tokens", defaults.MAX_TOKENS), field="sampling_params.max_tokens"
    )
    sampling = sampling_from_vllm(sp)
    st.limits.check_sampling_params(sampling, prefix="sampling_params.")
    return sampling


def fingerprint(obj: Any) -> str:
    """The body's meaning, not its formatting: key order and whitespace do not matter."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(canonical).hexdigest()


def parse_render(st: ApiState, obj: Any) -> Any:
    """The request, validated as the pipeline's rules say.

    Embedding keys are the fan-out's to sign: a client naming its own would choose where
    prefill reads from. So every item must bring its encoder inputs."""
    from schemas.validator import ValidationConfig, validate_features
    from schemas.vllm_wire import parse_generate_request

    req = parse_generate_request(obj)
    if req.features is None:
        raise ValidationError("vllm.features", "a render response needs features")
    validate_features(
        req.token_ids,
        req.features,
        req.ec_transfer_params or {},
        ValidationConfig.from_settings(
            st.settings, max_tensor_bytes=st.intake.fanout.limits.max_tensor_bytes
        ),
    )
    for modality, index, _ in req.features.items():
        slot = (req.features.kwargs_data or {}).get(modality, [None] * (index + 1))
        if index >= len(slot) or slot[index] is None:
            raise ValidationError(
                "vllm.encoder_inputs_required",
                "this endpoint fans out render responses: every item needs its kwargs_data "
                "(ec_transfer_params are signed by the fan-out, not given)",
                modality=modality,
                item=index,
            )
    return req
