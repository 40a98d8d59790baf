"""The OpenAI wire shapes this API takes and gives (what ``/openapi.json`` documents).

Requests forbid unknown fields (a misspelt parameter is a 422 naming it, never silently
ignored). Parameters OpenAI or vLLM define that would change the tokens and that this pipeline
cannot honour (``n`` > 1, penalties, logprobs, tools, structured output...) are accepted only at
their neutral value (:data:`NEUTRAL`); parameters that do not change the tokens (``user``,
``store``, ``service_tier``...) are accepted and have no effect. vLLM's extensions ``top_k``,
``ignore_eos``, ``stop_token_ids`` and ``cache_salt`` are honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from frontend.api.protocol import EXAMPLE_PNG_B64, Integer, Number
from frontend.api.schema_bounds import (
    CACHE_SALT,
    LIMIT,
    MAX_TOKENS,
    METADATA,
    SEED,
    SERVED_MODEL,
    STOP,
    STOP_TOKEN_IDS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Bounds,
    NeutralOnly,
)
from runtime.sampling_limits import MIN_TEMPERATURE
from schemas.vllm_sampling import NEUTRAL as SAMPLING_NEUTRAL

NEUTRAL: dict[str, tuple[Any, ...]] = {
    **SAMPLING_NEUTRAL,  # vLLM's sampling fields; OpenAI's logprobs is a flag, vLLM's a count
    "logprobs": (False, None),
    "top_logprobs": (0, None),
    "tools": (None, []),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "tool_choice": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "reasoning": (None, {}),
    "verbosity": (None,),
    "web_search_options": (None,),
    "skip_special_tokens": (True, None),
    "echo": (False, None),
    "add_generation_prompt": (True, None),
    "continue_final_message": (False, None),
    "previous_response_id": (None,),
    "conversation": (None,),
    "prompt": (None,),
    "include": (None, []),
    "truncation": (None, "disabled"),
    "text": (None, {}, {"format": {"type": "text"}}),
    "stream": (False, None),
}
"""Fields honoured only at these values (a route checks those of its own body)."""

_FORBID = ConfigDict(extra="forbid")

Neutral = Annotated[
    Any,
    Field(description="accepted at its neutral value only (unset, off)"),
    NeutralOnly(NEUTRAL),
]
"""A field accepted at its neutral value only (:data:`NEUTRAL`, checked by the route)."""
Ignored = Annotated[Any, Field(description="accepted; does not change the tokens")]
Served = Bounds(enum=SERVED_MODEL)
"""The one model name this server takes."""
Messages = Bounds(maxItems=LIMIT.max_messages)


# ------------------------------------------------------------------- chat completions: request


class ImageURL(BaseModel):
    model_config = _FORBID
    url: str = Field(
        description="a data: URL (data:image/png;base64,...), or an http(s) URL at a host of "
        "EPD_API_IMAGE_URL_HOSTS (none by default)"
    )
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted; the processor's own resolution bounds apply"
    )


class VideoURL(BaseModel):
    model_config = _FORBID
    url: str = Field(
        description="a data: URL of an MP4/MOV, WebM/MKV, GIF or WebP file, or an allowed "
        "http(s) URL"
    )


class TextPart(BaseModel):
    model_config = _FORBID
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = _FORBID
    type: Literal["image_url"]
    image_url: ImageURL


class VideoPart(BaseModel):
    """vLLM's video part (OpenAI has none)."""

    model_config = _FORBID
    type: Literal["video_url"]
    video_url: VideoURL


class AudioPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_audio"]


class FilePart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["file"]


class RefusalPart(BaseModel):
    model_config = _FORBID
    type: Literal["refusal"]
    refusal: str


ContentPart = Annotated[
    TextPart | ImagePart | VideoPart | AudioPart | FilePart | RefusalPart,
    Field(discriminator="type"),
]


class ChatMessageIn(BaseModel):
    """One message: ``content`` a string or a list of parts (text, ``image_url``,
    ``video_url``)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Neutral = None
    tool_call_id: Neutral = None
    function_call: Neutral = None
    refusal: str | None = None


class StreamOptions(BaseModel):
    model_config = _FORBID
    include_usage: bool | None = Field(
        None, description="a last chunk with the request's usage (and no choices)"
    )
    continuous_usage_stats: bool | None = Field(
        None, description="vLLM's: every chunk carries the usage so far"
    )


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` (OpenAI's, with vLLM's ``top_k``, ``ignore_eos``,
    ``stop_token_ids``, ``cache_salt``)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # OpenAI refuses "2" for 2 and 1 for true: so do we
        json_schema_extra={
            "examples": [
                {
                    "model": "tiny",
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "text", "text": "Describe this image."},
                                {
                                    "type": "image_url",
                                    "image_url": {
                                        "url": f"data:image/png;base64,{EXAMPLE_PNG_B64}"
                                    },
                                },
                            ],
                        }
                    ],
                    "max_tokens": 8,
                    "temperature": 0,
                }
            ]
        },
    )

    model: Annotated[str | None, Served] = Field(
        None, description="the served model (GET /v1/models)"
    )
    messages: Annotated[list[ChatMessageIn], Messages] = Field(min_length=1)
    max_tokens: Annotated[Integer | None, MAX_TOKENS] = Field(
        None, description="tokens to generate (unset: up to the context, EPD_MAX_TOKENS_LIMIT)"
    )
    max_completion_tokens: Annotated[Integer | None, MAX_TOKENS] = Field(
        None, description="the same as max_tokens"
    )
    temperature: Annotated[Number | None, TEMPERATURE] = Field(
        None, description=f"0: greedy; else at least {MIN_TEMPERATURE:g}; unset: 1 (OpenAI's)"
    )
    top_p: Annotated[Number | None, TOP_P] = None
    top_k: Annotated[Integer | None, TOP_K] = Field(
        None, description="vLLM's: the k most likely tokens; -1, 0: all"
    )
    seed: Annotated[Integer | None, SEED] = Field(None, description="same seed, same tokens")
    stop: Annotated[str | list[str] | None, STOP] = Field(
        None, description="stop strings (not returned)"
    )
    stop_token_ids: Annotated[list[Integer] | None, STOP_TOKEN_IDS] = Field(
        None, description="vLLM's"
    )
    ignore_eos: bool | None = Field(None, description="vLLM's: decode past end-of-sequence")
    cache_salt: Annotated[str | None, CACHE_SALT] = Field(
        None, description="vLLM's: encoder-cache isolation"
    )
    n: Annotated[Integer | None, NeutralOnly(NEUTRAL)] = Field(None, description="only 1")
    stream: bool | None = Field(None, description="server-sent chat.completion.chunk events")
    stream_options: StreamOptions | None = None
    metadata: Annotated[dict[str, str] | None, METADATA] = Field(
        None, description="labels kept on the record"
    )
    user: Ignored = None
    store: Ignored = None
    service_tier: Ignored = None
    parallel_tool_calls: Ignored = None
    prompt_cache_key: Ignored = None
    safety_identifier: Ignored = None
    best_of: Neutral = None
    presence_penalty: Neutral = None
    frequency_penalty: Neutral = None
    repetition_penalty: Neutral = None
    min_p: Neutral = None
    min_tokens: Neutral = None
    logprobs: Neutral = None
    top_logprobs: Neutral = None
    logit_bias: Neutral = None
    tools: Neutral = None
    tool_choice: Neutral = None
    functions: Neutral = None
    function_call: Neutral = None
    response_format: Neutral = None
    modalities: Neutral = None
    audio: Neutral = None
    prediction: Neutral = None
    reasoning_effort: Neutral = None
    verbosity: Neutral = None
    web_search_options: Neutral = None
    include_stop_str_in_output: Neutral = None
    skip_special_tokens: Neutral = None
    echo: Neutral = None
    add_generation_prompt: Neutral = None
    continue_final_message: Neutral = None


# ------------------------------------------------------------------ chat completions: answers


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"] | None
    logprobs: None = None


class ChatCompletion(BaseModel):
    """A whole answer (``stream`` false)."""

    id: str = Field(description="chatcmpl-<request id>: GET /v1/requests/<request id> shows it")
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChunkDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer; the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


# ---------------------------------------------------------------------- responses: request


class InputText(BaseModel):
    model_config = _FORBID
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Neutral = None


class InputImage(BaseModel):
    model_config = _FORBID
    type: Literal["input_image"]
    image_url: str | None = Field(None, description="a data: URL, or an allowed http(s) URL")
    file_id: Neutral = None
    detail: Literal["auto", "low", "high"] | None = None


class InputFile(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["input_file", "input_audio"]


InputPart = Annotated[InputText | InputImage | InputFile, Field(discriminator="type")]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputPart]
    id: str | None = None
    status: str | None = None


class ResponseRequest(BaseModel):
    """``POST /v1/responses``: ``input`` a string or messages of ``input_text`` and
    ``input_image`` parts; ``background`` answers at once (poll ``GET /v1/responses/{id}``)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # OpenAI refuses "2" for 2 and 1 for true: so do we
        json_schema_extra={
            "examples": [
                {
                    "model": "tiny",
                    "input": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "input_text", "text": "What is in this image?"},
                                {
                                    "type": "input_image",
                                    "image_url": f"data:image/png;base64,{EXAMPLE_PNG_B64}",
                                },
                            ],
                        }
                    ],
                    "max_output_tokens": 8,
                    "background": True,
                }
            ]
        },
    )

    model: Annotated[str | None, Served] = None
    input: Annotated[str | list[InputMessage], Messages]
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: Annotated[Integer | None, MAX_TOKENS] = None
    temperature: Annotated[Number | None, TEMPERATURE] = Field(
        None, description=f"0: greedy; else at least {MIN_TEMPERATURE:g}; unset: 1 (OpenAI's)"
    )
    top_p: Annotated[Number | None, TOP_P] = None
    top_k: Annotated[Integer | None, TOP_K] = Field(None, description="vLLM's")
    seed: Annotated[Integer | None, SEED] = Field(
        None, description="this API's: same seed, same tokens"
    )
    stop: Annotated[str | list[str] | None, STOP] = Field(
        None, description="this API's: stop strings"
    )
    ignore_eos: bool | None = Field(None, description="vLLM's")
    cache_salt: Annotated[str | None, CACHE_SALT] = Field(None, description="vLLM's")
    background: bool | None = Field(None, description="answer queued at once; poll by id")
    metadata: Annotated[dict[str, str] | None, METADATA] = None
    store: Ignored = None
    user: Ignored = None
    service_tier: Ignored = None
    parallel_tool_calls: Ignored = None
    max_tool_calls: Ignored = None
    prompt_cache_key: Ignored = None
    safety_identifier: Ignored = None
    stream: Neutral = None
    tools: Neutral = None
    tool_choice: Neutral = None
    text: Neutral = None
    reasoning: Neutral = None
    previous_response_id: Neutral = None
    conversation: Neutral = None
    prompt: Neutral = None
    include: Neutral = None
    truncation: Neutral = None
    top_logprobs: Neutral = None


# ---------------------------------------------------------------------- responses: answers


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["completed", "incomplete", "in_progress"]
    role: Literal["assistant"]
    content: list[OutputText]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    """A response, as created, polled and cancelled."""

    id: str = Field(description="resp_<request id>")
    object: Literal["response"]
    created_at: int
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled", "incomplete"]
    background: bool
    model: str
    output: list[OutputMessage]
    output_text: str | None = Field(None, description="the output's text, joined")
    error: ResponseError | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool
    tool_choice: str
    tools: list[Any]
    text: dict[str, Any]
    truncation: str
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str]


# ---------------------------------------------------------------------- models, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = Field(None, description="vLLM's: the context, in tokens")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(BaseModel):
    """OpenAI's error shape (the native API's own ``rule`` is its ``code``)."""

    error: OpenAIErrorDetail
