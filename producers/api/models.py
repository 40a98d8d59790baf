"""Pydantic models of the HTTP API: what ``/openapi.json`` documents, with examples."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict

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

    prompt: str | None = Field(None, description="text; <image> per image, <video> per video")
    token_ids: list[Annotated[int, Strict()]] | None = Field(
        None, description="prompt token ids; one <|image_pad|> per image"
    )
    images: list[str] = Field(default_factory=list, description="base64 or data: URL per image")
    videos: list[str | list[str]] = Field(
        default_factory=list,
        description="per video (<video> in the prompt, one <|video_pad|> in token_ids): a "
        "base64 or data: URL of an MP4/MOV, WebM/MKV, animated GIF or WebP file, or a list of "
        "base64/data: URL frame images (taken as already sampled at EPD_VIDEO_FPS). Frames are "
        "sampled at EPD_VIDEO_FPS (at most EPD_VIDEO_MAX_FRAMES); duration, frame count and "
        "frame size are checked from the file's headers before decoding",
    )
    max_tokens: Integer = Field(16, description="tokens to generate")
    temperature: Number = Field(
        0.0, description="0: greedy; above 0: sampled (temperature, then top_k, then top_p)"
    )
    top_p: Number = Field(1.0, description="nucleus sampling: the most likely tokens up to p")
    top_k: Integer = Field(0, description="the k most likely tokens; 0 (or -1): all")
    seed: Integer | None = Field(
        None, description="seeds the request's own generator (same seed, same tokens)"
    )
    stop: str | list[str] | None = Field(
        None, description="stop strings: generation ends at the first, which is not returned"
    )
    ignore_eos: bool = Field(False, description="keep decoding past the end-of-sequence token")
    cache_salt: str | None = Field(None, description="encoder-cache isolation")
    deadline_s: Number | None = Field(
        None, description="seconds from now after which work is not started"
    )
    metadata: dict[str, str] | None = Field(
        None, description="opaque labels returned with the status"
    )


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
