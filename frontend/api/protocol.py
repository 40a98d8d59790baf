"""Pydantic models of the HTTP API: what ``/openapi.json`` documents, with examples."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

from frontend.api.schema_bounds import (
    CACHE_SALT,
    LIMIT,
    MAX_TOKENS,
    METADATA,
    PROMPT_TOKEN_IDS,
    SEED,
    STOP,
    STOP_TOKEN_IDS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Bounds,
    Ref,
)
from runtime.sampling_limits import MIN_TEMPERATURE
from schemas.statuses import Status

# A 28x28 red PNG (the smallest the Qwen2-VL processor takes): an example that actually runs.
EXAMPLE_PNG_B64 = (
    "iVBORw0KGgoAAAANSUhEUgAAABwAAAAcCAIAAAD9b0jDAAAAKElEQVR42mM8ISfHQG3AxEADMGroqKGjho4aOmro"
    "qKGjho4aOvgMBQB+BAE8FfyCFgAAAABJRU5ErkJggg=="
)


def _not_bool(value: Any) -> Any:
    # JSON true is not the integer 1 (pydantic's lax mode would take it as one).
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


TEMPERATURE_NOTE = (
    f"0: greedy; else at least {MIN_TEMPERATURE:g}: sampled (temperature, then top_k, then "
    "top_p, as transformers' warpers)"
)
METADATA_NOTE = Bounds(
    description=Ref(
        lambda ctx: (
            "opaque labels returned with the status; keys and values together at most "
            f"{ctx.limits.max_metadata_bytes} bytes (UTF-8)"
        )
    )
)

Integer = Annotated[int, BeforeValidator(_not_bool)]
Number = Annotated[float, BeforeValidator(_not_bool), Field(allow_inf_nan=False)]


class SubmitRequest(BaseModel):
    """A generation request: a prompt (``<image>`` marks each image, ``<video>`` each video) or
    token ids, plus images and videos (JSON bodies only for videos).

    Images are base64 strings or ``data:image/...;base64,`` URLs: data, never file paths or
    URLs; videos likewise (``data:video/mp4;base64,...``) or lists of frame images. Decoding
    is greedy at ``temperature`` 0 (the default), else sampled (``top_p``, ``top_k``,
    ``seed``); ``stop`` strings end it.

    The model holds the fields' types; their bounds come from the settings
    (:class:`runtime.request_limits.RequestLimits`), which the routes check and
    ``/openapi.json`` documents.
    """

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "prompt": "Describe <image>.",
                    "images": [f"data:image/png;base64,{EXAMPLE_PNG_B64}"],
                    "max_tokens": 8,
                }
            ]
        },
    )

    prompt: Annotated[str | None, Bounds(maxLength=LIMIT.max_prompt_chars)] = Field(
        None, description="text; <image> per image, <video> per video"
    )
    token_ids: Annotated[list[Annotated[int, Strict()]] | None, PROMPT_TOKEN_IDS] = Field(
        None, description="prompt token ids; one <|image_pad|> per image"
    )
    images: Annotated[list[str], Bounds(maxItems=LIMIT.max_images)] = Field(
        default_factory=list, description="base64 or data: URL per image"
    )
    videos: Annotated[list[str | list[str]], Bounds(maxItems=LIMIT.max_videos)] = Field(
        default_factory=list,
        description="per video (<video> in the prompt, one <|video_pad|> in token_ids): a "
        "base64 or data: URL of an MP4/MOV, WebM/MKV, animated GIF or WebP file, or a list of "
        "base64/data: URL frame images (taken as already sampled at EPD_VIDEO_FPS). Frames are "
        "sampled at EPD_VIDEO_FPS (at most EPD_VIDEO_MAX_FRAMES); duration, frame count and "
        "frame size are checked from the file's headers before decoding",
    )
    max_tokens: Annotated[Integer, MAX_TOKENS] = Field(16, description="tokens to generate")
    temperature: Annotated[Number, TEMPERATURE] = Field(0.0, description=TEMPERATURE_NOTE)
    top_p: Annotated[Number, TOP_P] = Field(
        1.0, description="nucleus sampling: the most likely tokens up to p"
    )
    top_k: Annotated[Integer, TOP_K] = Field(
        0, description="the k most likely tokens; 0 (or -1): all"
    )
    seed: Annotated[Integer | None, SEED] = Field(
        None, description="seeds the request's own generator (same seed, same tokens)"
    )
    stop: Annotated[str | list[str] | None, STOP] = Field(
        None, description="stop strings: generation ends at the first, which is not returned"
    )
    ignore_eos: bool = Field(False, description="keep decoding past the end-of-sequence token")
    cache_salt: Annotated[str | None, CACHE_SALT] = Field(
        None, description="encoder-cache isolation"
    )
    deadline_s: Annotated[
        Number | None, Bounds(exclusiveMinimum=0, maximum=LIMIT.max_deadline_s)
    ] = Field(None, description="seconds from now after which work is not started")
    metadata: Annotated[dict[str, str] | None, METADATA, METADATA_NOTE] = Field(
        None, description="opaque labels returned with the status"
    )


FORM_AS_JSON = {"token_ids": "JSON list of token ids", "metadata": "JSON object of string labels"}
"""The form fields that carry JSON text (everything else is a plain value)."""


def form_schema(body: dict[str, Any]) -> dict[str, Any]:
    """The ``multipart/form-data`` shape of a (bounded) :class:`SubmitRequest` schema: a value
    per field, ``images`` as files, ``stop`` repeated per string, ``token_ids`` and
    ``metadata`` as JSON text; no ``videos`` (JSON bodies only)."""
    props: dict[str, Any] = {}
    for name, prop in body["properties"].items():
        branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
        if name in FORM_AS_JSON:
            props[name] = {"type": "string", "description": FORM_AS_JSON[name]}
        elif name == "images":
            props[name] = {**prop, "items": {"type": "string", "format": "binary"}}
        elif name == "stop":
            many = next(b for b in branches if b.get("type") == "array")
            props[name] = {**many, "description": "repeat per string"}
        elif name != "videos":
            props[name] = {k: v for k, v in branches[0].items() if k != "title"}
    return {"type": "object", "properties": props}


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def absent() -> Any:
    """A documented field a body may leave out (no default is documented: the route's parser
    says what an absent field means)."""
    return Field(None, json_schema_extra=_no_default)


class VllmFeatures(BaseModel):
    """A render response's features (``schemas.vllm_wire``)."""

    mm_hashes: dict[str, Any] = absent()
    mm_placeholders: dict[str, Any] = absent()
    kwargs_data: dict[str, Any] | None = absent()
    mm_metadata: dict[str, Any] | None = absent()


class VllmSamplingParams(BaseModel):
    """vLLM's SamplingParams (its defaults: temperature 1, max_tokens 16); fields that would
    change the tokens and are not supported (n > 1, penalties, logprobs...) are refused."""

    max_tokens: Annotated[int, MAX_TOKENS] = absent()
    temperature: Annotated[float, TEMPERATURE] = absent()
    top_p: Annotated[float, TOP_P] = absent()
    top_k: Annotated[int, TOP_K] = absent()
    seed: Annotated[int | None, SEED] = absent()
    stop: Annotated[str | list[str], STOP] = absent()
    stop_token_ids: Annotated[list[int], STOP_TOKEN_IDS] = absent()
    ignore_eos: bool = absent()


class VllmGenerateRequest(BaseModel):
    """A vLLM render response or GenerateRequest; every item brings its kwargs_data (the
    fan-out signs the embedding entries). Documentation only: the route parses the body with
    :func:`schemas.vllm_wire.parse_generate_request`."""

    request_id: Annotated[str, Bounds(minLength=1, maxLength=LIMIT.max_id_chars)] = absent()
    token_ids: Annotated[list[int], PROMPT_TOKEN_IDS, Bounds(minItems=1)]
    features: VllmFeatures
    sampling_params: VllmSamplingParams = absent()
    cache_salt: Annotated[str | None, CACHE_SALT] = absent()


class Accepted(BaseModel):
    """The request was admitted and enqueued (or found again by its Idempotency-Key)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "request_id": "5f0c3e1b9a3b4a7f8e2d1c0b9a8f7e6d",
                    "status": "queued",
                    "status_url": "/v1/requests/5f0c3e1b9a3b4a7f8e2d1c0b9a8f7e6d",
                    "events_url": "/v1/requests/5f0c3e1b9a3b4a7f8e2d1c0b9a8f7e6d/events",
                }
            ]
        }
    )

    request_id: str
    status: Status
    status_url: str
    events_url: str


class StageTiming(BaseModel):
    started: str | None = Field(None, description="ISO-8601 UTC")
    finished: str | None = Field(None, description="ISO-8601 UTC")
    ms: float | None = Field(None, description="time spent in the stage's compute")


class Stages(BaseModel):
    render: StageTiming = Field(default_factory=StageTiming)
    encode: StageTiming = Field(default_factory=StageTiming)
    prefill: StageTiming = Field(default_factory=StageTiming)
    decode: StageTiming = Field(default_factory=StageTiming)


class Item(BaseModel):
    modality: str
    mm_hash: str
    cache_hit: bool | None = Field(None, description="embedding already in the store")
    encoded: bool = Field(description="the embedding is known to be in the store")


class Result(BaseModel):
    token_ids: list[int]
    text: str | None = None


class ErrorDetail(BaseModel):
    code: str
    message: str
    rule: str | None = None
    modality: str | None = None
    item: int | None = None
    field: str | None = None


class RequestStatus(BaseModel):
    """Where a request is, how long each stage took, and its outcome."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "request_id": "5f0c3e1b9a3b4a7f8e2d1c0b9a8f7e6d",
                    "status": "completed",
                    "created_at": "2026-11-30T12:00:00.000Z",
                    "stages": {
                        "render": {"started": None, "finished": None, "ms": 12.5},
                        "encode": {"started": None, "finished": None, "ms": 30.1},
                        "prefill": {"started": None, "finished": None, "ms": 4.0},
                        "decode": {"started": None, "finished": None, "ms": 20.0},
                    },
                    "items": [
                        {
                            "modality": "image",
                            "mm_hash": "ab12",
                            "cache_hit": False,
                            "encoded": True,
                        }
                    ],
                    "result": {"token_ids": [17, 42], "text": "hi"},
                    "error": None,
                }
            ]
        }
    )

    request_id: str
    status: Status
    created_at: str
    updated_at: str | None = None
    stages: Stages
    items: list[Item]
    result: Result | None = None
    error: ErrorDetail | None = None
    metadata: dict[str, str] | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str
    checks: dict[str, Any] = Field(default_factory=dict)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": desc}
    for code, desc in {
        400: "malformed request (bad JSON, bad base64, bad form)",
        401: "missing or unknown bearer token (when EPD_API_TOKENS is set)",
        404: "unknown request id (or another tenant's)",
        408: "the body did not arrive within EPD_API_BODY_TIMEOUT_S (the connection closes)",
        409: "Idempotency-Key reused with another body, or cancel of a finished request",
        413: "body or image too large",
        415: "unsupported content or image type",
        422: "validation failed (the rule is named)",
        429: "too many requests in flight or encoder backlog; see Retry-After",
        503: "Kafka or Redis unavailable, or the body budget spent; see Retry-After",
    }.items()
}
