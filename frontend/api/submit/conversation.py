"""An OpenAI request body -> the conversation it asks for, its media and its sampling.

Parse (:func:`json_object`): the JSON text, texts far over ``EPD_API_MAX_PROMPT_CHARS``
refused from the raw bytes. Check (:func:`check_chat`, :func:`check_response`; nothing is
stored, nothing fetched): message and part counts (``EPD_API_MAX_MESSAGES`` /
``EPD_API_MAX_MESSAGE_PARTS``) and image and video counts before pydantic copies the body,
its schema, the parameters this pipeline cannot honour (:data:`models.NEUTRAL`), the model
name, every text part (no vision tokens, no special tokens, alone or joined to the text parts
before it; all of it within ``EPD_API_MAX_PROMPT_CHARS``), every ``http(s)`` URL against the
allow-list (:class:`frontend.api.submit.media_urls.MediaFetcher`), and the sampling
parameters against the request limits. Media (:func:`with_media`): every ``data:`` URL (size
before decoding, type from the bytes). Allowed URLs are fetched later, in the request's render.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from frontend.api.errors import ApiError
from frontend.api.openai_compat.errors import schema_error
from frontend.api.openai_compat.protocol import (
    NEUTRAL,
    ChatCompletionRequest,
    ChatMessageIn,
    InputMessage,
    ResponseRequest,
)
from frontend.api.submit.json_text import fingerprint, parse_json, refuse_long_text
from frontend.api.submit.media import decode_part
from frontend.api.submit.media_urls import MediaFetcher, MediaRef
from producers.chat import ChatMessage, ChatPart, check_run
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from schemas.errors import ValidationError
from schemas.types import SamplingParams
from schemas.vllm_sampling import is_neutral, pipeline_top_k

OPENAI_TEMPERATURE = 1.0
"""OpenAI samples at temperature 1 when a request names none."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""The roles a conversation may hold, as the chat template is given them (OpenAI's
``developer`` is the system message of models that have no such role)."""


@dataclass(slots=True)
class Media:
    """One image or video of a conversation: the URL it came as, then its bytes (a ``data:``
    URL decoded by :func:`with_media`), or the allowed URL the render fetches them from."""

    kind: Literal["image", "video"]
    ref: MediaRef
    data: bytes | None = None
    url: str | None = None


@dataclass(slots=True)
class Conversation:
    """What a body asks for, checked (see the module docstring)."""

    messages: list[ChatMessage]
    media: list[Media]
    sampling: SamplingParams
    max_tokens_given: bool
    """False: ``max_tokens`` is the most the context leaves (set once the prompt is known)."""
    cache_salt: str | None = None
    metadata: dict[str, str] | None = None
    fingerprint: str = ""
    stream: bool = False
    include_usage: bool = False
    background: bool = False
    model: str = ""
    root: str = "messages"
    """The field that holds the conversation (``messages``, or ``input`` for a response)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats``: every chunk carries the usage so far."""
    front: dict[str, Any] = field(default_factory=dict)
    """What the record keeps for the route's views (set with the submission)."""

    def name_part(self, exc: ValidationError | ApiError) -> None:
        """Point ``exc.field`` at what the client wrote (``param`` of OpenAI's errors): the part
        of the item a renderer's, fetch's or worker's error names by modality and index, else
        the conversation for an error of the prompt as a whole (a context overflow, a
        template's refusal), never a field of the native event (``token_ids``)."""
        ref = next(
            (
                m.ref
                for m in self.media
                if exc.item is not None and (m.ref.modality, m.ref.item) == (exc.modality, exc.item)
            ),
            None,
        )
        if ref is not None:
            exc.field = ref.field
        elif exc.field is None or exc.field.split("[")[0] in NATIVE_FIELDS:
            exc.field, exc.item = self.root, None


NATIVE_FIELDS = frozenset({"prompt", "token_ids", "images", "videos", "features.mm_hashes"})
"""Fields of the native request and event that an error past the parse may name: a
conversation has none of them."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """What a conversation is checked against: this server's limits and settings, its media
    URL allow-list, and what the served model takes."""

    limits: RequestLimits
    settings: Settings
    fetcher: MediaFetcher
    video: bool
    """The family takes video."""
    control: Sequence[str] = ()
    """The tokenizer's special tokens no message text may hold (:func:`control_tokens`)."""


@dataclass(slots=True)
class Builder:
    """Collects messages and media, holding them to the limits as it goes."""

    d: Deployment
    messages: list[ChatMessage] = field(default_factory=list)
    media: list[Media] = field(default_factory=list)
    chars: int = 0
    run: str = ""
    """The end of the message's text parts since its last item: the template joins the next
    text part to it, so a special token split over parts is one (:func:`check_run`)."""

    def message(self, role: str, where: str) -> ChatMessage:
        if role not in ROLES:
            raise unsupported(where + ".role", f"role {role!r} (tools are not supported)")
        msg = ChatMessage(ROLES[role])
        self.messages.append(msg)
        self.run = ""
        return msg

    def text(self, msg: ChatMessage, text: str, where: str) -> None:
        self.run = check_run(self.run, text, where, self.d.control)
        self.chars += len(text)
        if self.chars > self.d.limits.max_prompt_chars:
            raise ValidationError(
                "request.prompt",
                f"the messages hold more than {self.d.limits.max_prompt_chars} characters "
                "(EPD_API_MAX_PROMPT_CHARS)",
                field=where,
            )
        msg.parts.append(ChatPart("text", text, where))

    def item(self, msg: ChatMessage, kind: Literal["image", "video"], url: str, where: str) -> None:
        index = sum(m.kind == kind for m in self.media)
        ref = MediaRef(where, index, kind)
        if kind == "video" and not self.d.video:
            raise unsupported(where, "video (this model family takes none)")
        if not url.startswith("data:"):
            self.d.fetcher.check(url, ref)  # refused here, before anything connects
        self.media.append(Media(kind, ref, url=url))  # a data: URL is decoded by with_media
        msg.parts.append(ChatPart(kind, where=where))
        self.run = ""  # the template writes the item's vision block after the text


def unsupported(where: str, what: str) -> ValidationError:
    return ValidationError("request.unsupported", f"{what} is not supported", field=where)


def check_neutral(obj: dict[str, Any], names: set[str]) -> None:
    """Rule ``request.unsupported`` for a parameter of ``names`` set to anything but its
    neutral value (:data:`models.NEUTRAL`)."""
    for name in sorted(names & obj.keys()):
        value, neutral = obj[name], NEUTRAL[name]
        if not is_neutral(value, neutral):
            shown = json.dumps(value)[:80]
            raise ValidationError(
                "request.unsupported",
                f"{name} = {shown} is not supported (only {json.dumps(neutral[0])})",
                field=name,
            )


def _validate(model: type[BaseModel], obj: Any) -> Any:
    try:
        return model.model_validate(obj)
    except PydanticValidationError as exc:
        raise schema_error(exc) from None


TEXT_KEYS = ("content", "text", "refusal", "input", "instructions")
"""Keys whose string values are message text (held to ``EPD_API_MAX_PROMPT_CHARS``)."""


def json_object(body: bytes, limits: RequestLimits) -> dict[str, Any]:
    """Parse: the body's JSON object, long texts refused from the raw bytes first."""
    refuse_long_text(body, TEXT_KEYS, limits.max_prompt_chars)  # before the parse
    obj = parse_json(body, limits.max_json_depth)
    if not isinstance(obj, dict):
        raise ValidationError("request.schema", "the body must be a JSON object")
    return obj


def _count(items: Any, limits: RequestLimits, where: str) -> None:
    """Messages, parts, images and videos counted in the raw body, before it is parsed."""
    if not isinstance(items, list):
        return
    parts = [m.get("content") for m in items if isinstance(m, dict)]
    lists = [p for p in parts if isinstance(p, list)]
    limits.check_chat_counts(len(items), max((len(p) for p in lists), default=0), where)
    kinds = [x.get("type") for p in lists for x in p if isinstance(x, dict)]
    limits.check_counts(
        kinds.count("image_url") + kinds.count("input_image"), kinds.count("video_url")
    )


def sampling_of(
    limits: RequestLimits,
    req: ChatCompletionRequest | ResponseRequest,
    max_tokens: int | None,
    max_tokens_field: str,
) -> SamplingParams:
    """The request's ``SamplingParams``, held to the limits (OpenAI's defaults: temperature 1,
    ``max_tokens`` up to the context; ``max_tokens``: the value of ``max_tokens_field``)."""
    if max_tokens is not None:
        limits.check_max_tokens(max_tokens, field=max_tokens_field)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    s = SamplingParams(
        max_tokens=limits.max_tokens if max_tokens is None else max_tokens,
        temperature=OPENAI_TEMPERATURE if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=pipeline_top_k(req.top_k),
        seed=req.seed,
        stop=stops,
        stop_token_ids=list(getattr(req, "stop_token_ids", None) or []),  # chat's only
        ignore_eos=bool(req.ignore_eos),
    )
    limits.check_sampling_params(s)
    return s


def check_model(name: str | None, served: str) -> None:
    """404 ``model_not_found`` for a model this API does not serve."""
    if name is not None and name != served:
        raise ApiError(
            404,
            "not_found",
            f"the model {name!r} does not exist; this API serves {served!r} (GET /v1/models)",
            rule="model_not_found",
            field="model",
        )


# ------------------------------------------------------------------------- chat completions


def check_chat(obj: dict[str, Any], d: Deployment) -> Conversation:
    """Check: a ``/v1/chat/completions`` body as the conversation it asks for."""
    _count(obj.get("messages"), d.limits, "messages")
    req: ChatCompletionRequest = _validate(ChatCompletionRequest, obj)
    check_neutral(obj, set(NEUTRAL) - {"stream"})
    check_model(req.model, d.settings.model_name())
    b = Builder(d)
    for i, m in enumerate(req.messages):
        _chat_message(b, m, f"messages[{i}]")
    if req.max_tokens is not None and req.max_completion_tokens not in (None, req.max_tokens):
        raise ValidationError(
            "request.schema",
            "max_tokens and max_completion_tokens disagree; give one",
            field="max_completion_tokens",
        )
    given = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    named = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    sampling = sampling_of(d.limits, req, given, named)
    options = req.stream_options
    if options is not None and not req.stream:
        raise ValidationError(
            "request.schema",
            "stream_options is only taken with stream: true",
            field="stream_options",
        )
    return Conversation(
        b.messages,
        b.media,
        sampling,
        max_tokens_given=given is not None,
        cache_salt=req.cache_salt,
        metadata=req.metadata,
        fingerprint=fingerprint(obj),
        stream=bool(req.stream),
        include_usage=bool(options and options.include_usage),
        model=d.settings.model_name(),
        continuous_usage=bool(options and options.continuous_usage_stats),
    )


def _chat_message(b: Builder, m: ChatMessageIn, where: str) -> None:
    if m.tool_calls not in (None, []) or m.function_call is not None:
        raise unsupported(f"{where}.tool_calls", "tool calls")
    msg = b.message(m.role, where)
    content = m.content
    if content is None:
        if m.role != "assistant":
            raise ValidationError(
                "request.schema",
                f"{where}.content: a {m.role} message needs content",
                field=f"{where}.content",
            )
        return
    if isinstance(content, str):
        b.text(msg, content, f"{where}.content")
        return
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if part.type == "text":
            b.text(msg, part.text, at)
        elif part.type == "refusal":
            b.text(msg, part.refusal, at)
        elif part.type == "image_url":
            b.item(msg, "image", part.image_url.url, f"{at}.image_url.url")
        elif part.type == "video_url":
            b.item(msg, "video", part.video_url.url, f"{at}.video_url.url")
        else:
            raise unsupported(at, f"a content part of type {part.type!r}")


# ------------------------------------------------------------------------------- responses


def check_response(obj: dict[str, Any], d: Deployment) -> Conversation:
    """Check: a ``/v1/responses`` body as the conversation it asks for."""
    _count(obj.get("input"), d.limits, "input")
    req: ResponseRequest = _validate(ResponseRequest, obj)
    check_neutral(obj, set(NEUTRAL))
    check_model(req.model, d.settings.model_name())
    b = Builder(d)
    if req.instructions is not None:
        b.text(b.message("system", "instructions"), req.instructions, "instructions")
    if isinstance(req.input, str):
        b.text(b.message("user", "input"), req.input, "input")
    else:
        for i, m in enumerate(req.input):
            _input_message(b, m, f"input[{i}]")
    if not b.messages:
        raise ValidationError("request.schema", "input holds no message", field="input")
    sampling = sampling_of(d.limits, req, req.max_output_tokens, "max_output_tokens")
    return Conversation(
        b.messages,
        b.media,
        sampling,
        max_tokens_given=req.max_output_tokens is not None,
        cache_salt=req.cache_salt,
        metadata=req.metadata,
        fingerprint=fingerprint(obj),
        background=bool(req.background),
        model=d.settings.model_name(),
        root="input",
    )


def _input_message(b: Builder, m: InputMessage, where: str) -> None:
    msg = b.message(m.role, where)
    if isinstance(m.content, str):
        b.text(msg, m.content, f"{where}.content")
        return
    for j, part in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if part.type in ("input_text", "output_text"):
            b.text(msg, part.text, at)  # type: ignore[union-attr]
        elif part.type == "input_image":
            if part.file_id is not None or part.image_url is None:  # type: ignore[union-attr]
                raise unsupported(at, "an input_image without an image_url (file ids)")
            b.item(msg, "image", part.image_url, f"{at}.image_url")  # type: ignore[union-attr]
        else:
            raise unsupported(at, f"a content part of type {part.type!r}")


def with_media(conv: Conversation, settings: Settings) -> Conversation:
    """Media: every ``data:`` URL of the conversation decoded, sized and sniffed (errors name
    its part); allowed ``http(s)`` URLs stay for the render to fetch."""
    for m in conv.media:
        if m.url is not None and m.url.startswith("data:"):
            m.data, m.url = decode_part(m.url, m.ref, settings), None
    return conv


def parse_conversation(
    check: Callable[[dict[str, Any], Deployment], Conversation], body: bytes, d: Deployment
) -> Conversation:
    """A body parsed, checked by ``check`` (:func:`check_chat`, :func:`check_response`) and
    its media decoded, as the door reads one (in one call: for tests)."""
    return with_media(check(json_object(body, d.limits), d), d.settings)
