"""``/v1/vllm/generate``'s door on the one path (:func:`frontend.api.submit.submit_body`): a vLLM
render response / ``GenerateRequest`` -> the intake.

Parse: the JSON text. Check (:func:`door_checks`): what the request limits say of the body's
own fields, before its tensors are decoded. Media (:func:`parse_render`): the tensors decoded
(base64 + msgpack) and validated as the pipeline's rules say; every item brings its encoder
inputs. The render only wraps what came: nothing is left for a render slot to decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from frontend.api.errors import ApiError
from frontend.api.submit import SubmitHeaders
from frontend.api.submit.json_text import fingerprint, parse_json
from frontend.api.submit.reading import JSON, off_the_loop
from producers.intake import RenderContext, Submission
from schemas import defaults
from schemas.errors import ValidationError
from schemas.types import RenderEvent, SamplingParams
from schemas.vllm_sampling import sampling_from_vllm

if TYPE_CHECKING:
    from frontend.api.state import ApiState


@dataclass(frozen=True, slots=True)
class VllmChecked:
    """A body the request limits accept: its object and its sampling parameters."""

    obj: dict[str, Any]
    sampling: SamplingParams


@dataclass(frozen=True, slots=True)
class VllmInput:
    """A body with its tensors decoded and validated."""

    obj: dict[str, Any]
    sampling: SamplingParams
    request: Any
    """The parsed ``GenerateRequest`` (:func:`schemas.vllm_wire.parse_generate_request`)."""
    fingerprint: str


@dataclass(frozen=True, slots=True)
class VllmDoor:
    """``POST /v1/vllm/generate``'s phases."""

    st: ApiState
    accepts: tuple[str, ...] = (JSON,)

    async def parse(self, request: Request, ctype: str, body: bytes) -> Any:
        st = self.st
        depth = st.limits.max_json_depth
        return await off_the_loop(len(body), parse_json, body, depth, slot=st.bodies.parsing)

    def work_bytes(self, parsed: Any, body_bytes: int) -> int:
        """The body's bytes: a JSON body, decoded whole."""
        return body_bytes

    def check(self, obj: Any) -> VllmChecked:
        return VllmChecked(obj, door_checks(self.st, obj))

    def media(self, body: VllmChecked) -> VllmInput:
        # Base64 + msgpack decoding of megabytes of tensors (run off the loop by the path).
        req = parse_render(self.st, body.obj)
        return VllmInput(body.obj, body.sampling, req, fingerprint(body.obj))

    def submission(self, inp: VllmInput, tenant: str | None, headers: SubmitHeaders) -> Submission:
        return vllm_submission(self.st, inp, tenant, headers)

    def blame(self, inp: VllmInput, exc: ValidationError | ApiError) -> None:
        """A vLLM body's errors name its own fields already."""


def vllm_submission(
    st: ApiState, inp: VllmInput, tenant: str | None, headers: SubmitHeaders
) -> Submission:
    """A checked vLLM body as the intake's :class:`Submission`."""
    obj, req = inp.obj, inp.request
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

    return Submission(
        render=render,
        sampling=inp.sampling,
        tenant=tenant,
        cache_salt=obj.get("cache_salt"),
        metadata={"vllm_request_id": vllm_id} if vllm_id else None,
        foreign_labels=True,
        traceparent=headers.traceparent,
        idempotency_key=headers.idempotency_key,
        fingerprint=inp.fingerprint,
        decodes_media=False,  # its tensors come decoded: nothing for a render slot to bound
        door_checked=True,  # door_checks: sampling_params and the items counted
    )


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
