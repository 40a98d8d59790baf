"""Every bound a request is held to at the door, from the settings and the model: one home.

The HTTP routes (native, vLLM and OpenAI-compatible), the intake and ``/openapi.json``
read the same :class:`RequestLimits`, built once from the settings and the model's render
info (vocabulary, context); the prefill and decode workers build it from the same settings and
their model and call :meth:`RequestLimits.check_prefill` on every event, so what is
documented, what is refused at the door and what the workers refuse (a record written straight
to a topic included) agree, rule and message. The sampling checks are the
:class:`~runtime.sampling_limits.SamplingLimits` part of it; every check is worded by
:mod:`runtime.bounds`, as the renderer's and the compute guard's vocabulary and context checks
are. Each check raises ``schemas.errors.ValidationError`` naming its rule and field; rules that
mean "send less" are answered 413 by the API, the others 422.

What the door cannot know (an embedding that never arrives, a deadline passing in a queue)
stays the workers' to report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.bounds import at_most, context_overflow, outside_vocabulary
from runtime.sampling_limits import SamplingLimits
from schemas import defaults
from schemas.errors import ValidationError
from schemas.values import is_finite

if TYPE_CHECKING:
    from runtime.settings import Settings
    from schemas.types import PrefillEvent, RenderEvent, SamplingParams

MAX_DEADLINE_S = 86400.0

SIZE_RULES = frozenset(
    {
        "request.metadata",
        "request.cache_salt",
        "request.request_id",
        "request.mm_hash",
        "request.prompt",
        "image.count",
        "video.count",
        "request.messages",
    }
)
"""Rules of this module that mean "too large" (the client must send less)."""


def context_limit(settings: Settings, model_context: int) -> int:
    """Most tokens (prompt + generated) one request may hold: the model's context, capped by
    ``EPD_MAX_CONTEXT_TOKENS`` when that is set (never above the model's)."""
    if settings.max_context_tokens:
        return min(model_context, settings.max_context_tokens)
    return model_context


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestLimits(SamplingLimits):
    """What one deployment accepts per request; see the settings named on each field. The
    sampling bounds (``max_tokens``, the vocabulary, the stop conditions) and their checks
    are :class:`~runtime.sampling_limits.SamplingLimits`'."""

    context_tokens: int
    """Prompt tokens + ``max_tokens``: the model's context (``EPD_MAX_CONTEXT_TOKENS``)."""
    max_images: int
    """``EPD_API_MAX_IMAGES``."""
    max_videos: int
    """``EPD_API_MAX_VIDEOS``."""
    max_prompt_chars: int
    """``EPD_API_MAX_PROMPT_CHARS``."""
    max_cache_salt_chars: int
    """``EPD_API_MAX_CACHE_SALT_CHARS``."""
    max_metadata_keys: int
    """``EPD_API_MAX_METADATA_KEYS``."""
    max_metadata_chars: int
    """``EPD_API_MAX_METADATA_CHARS``: one key or one value."""
    max_metadata_bytes: int
    """``EPD_API_MAX_METADATA_BYTES``: all keys and values together, UTF-8."""
    max_id_chars: int
    """``EPD_API_MAX_ID_CHARS``: a client's request id, ``Idempotency-Key``, item label."""
    max_json_depth: int
    """``EPD_API_MAX_JSON_DEPTH``: nesting of objects and arrays in a JSON body."""
    max_wait_s: float
    """``EPD_API_MAX_WAIT_S``: longest long-poll."""
    max_messages: int = defaults.API_MAX_MESSAGES
    """``EPD_API_MAX_MESSAGES``: messages of a chat request (input items of a response)."""
    max_message_parts: int = defaults.API_MAX_MESSAGE_PARTS
    """``EPD_API_MAX_MESSAGE_PARTS``: content parts of one message."""
    max_deadline_s: float = MAX_DEADLINE_S

    @classmethod
    def from_settings(
        cls, settings: Settings, *, vocab_size: int, model_context: int
    ) -> RequestLimits:
        """The limits of ``settings`` for a model with this vocabulary and context."""
        return cls(
            max_tokens=settings.max_tokens_limit,
            context_tokens=context_limit(settings, model_context),
            vocab_size=vocab_size,
            max_images=settings.api_max_images,
            max_videos=settings.api_max_videos,
            max_prompt_chars=settings.api_max_prompt_chars,
            max_cache_salt_chars=settings.api_max_cache_salt_chars,
            max_metadata_keys=settings.api_max_metadata_keys,
            max_metadata_chars=settings.api_max_metadata_chars,
            max_metadata_bytes=settings.api_max_metadata_bytes,
            max_id_chars=settings.api_max_id_chars,
            max_json_depth=settings.api_max_json_depth,
            max_wait_s=settings.api_max_wait_s,
            max_stop_strings=settings.max_stop_strings,
            max_stop_string_chars=settings.max_stop_string_chars,
            max_stop_token_ids=settings.max_stop_token_ids,
            max_messages=settings.api_max_messages,
            max_message_parts=settings.api_max_message_parts,
        )

    # ---------------------------------------------------------------- before anything runs

    def check_chat_counts(self, messages: int, parts: int, where: str = "messages") -> None:
        """At most ``EPD_API_MAX_MESSAGES`` messages and ``EPD_API_MAX_MESSAGE_PARTS``
        content parts in any one of them (counted before any is parsed)."""
        rule = "request.messages"
        at_most(
            messages,
            self.max_messages,
            "EPD_API_MAX_MESSAGES",
            rule,
            f"{messages} messages",
            field=where,
        )
        at_most(
            parts,
            self.max_message_parts,
            "EPD_API_MAX_MESSAGE_PARTS",
            rule,
            f"a message has {parts} content parts",
            field=where,
        )

    def check_deadline(self, deadline_s: Any, field: str = "deadline_s") -> None:
        """A deadline in seconds from now: a finite number in ``(0, 86400]``."""
        if deadline_s is None:
            return
        if not is_finite(deadline_s):
            raise ValidationError(
                "request.deadline", "deadline_s must be a finite number", field=field
            )
        if not 0 < deadline_s <= self.max_deadline_s:
            raise ValidationError(
                "request.deadline",
                f"deadline_s is {deadline_s}; it must be above 0 and at most "
                f"{self.max_deadline_s:g}",
                field=field,
            )

    def check_cache_salt(self, salt: Any, field: str = "cache_salt") -> None:
        """A string of at most ``max_cache_salt_chars`` characters (or none)."""
        if salt is None:
            return
        if not isinstance(salt, str):
            raise ValidationError("request.schema", "cache_salt must be a string", field=field)
        at_most(
            len(salt),
            self.max_cache_salt_chars,
            "EPD_API_MAX_CACHE_SALT_CHARS",
            "request.cache_salt",
            f"cache_salt has {len(salt)} characters",
            field=field,
        )

    def check_id(self, value: Any, field: str, rule: str = "request.request_id") -> None:
        """A client-given id: a non-empty string of at most ``max_id_chars`` (or none)."""
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise ValidationError("request.schema", f"{field} must be a string", field=field)
        at_most(
            len(value),
            self.max_id_chars,
            "EPD_API_MAX_ID_CHARS",
            rule,
            f"{field} has {len(value)} characters",
            field=field,
        )

    def check_metadata(self, metadata: Mapping[str, Any] | None) -> None:
        """At most ``max_metadata_keys`` string labels, each key and value at most
        ``max_metadata_chars``, all together at most ``max_metadata_bytes`` (UTF-8)."""
        if metadata is None:
            return
        rule, field = "request.metadata", "metadata"
        at_most(
            len(metadata),
            self.max_metadata_keys,
            "EPD_API_MAX_METADATA_KEYS",
            rule,
            f"metadata has {len(metadata)} keys",
            field=field,
        )
        total = 0
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValidationError(
                    "request.schema", "metadata keys and values must be strings", field="metadata"
                )
            longest = max(len(key), len(value))
            at_most(
                longest,
                self.max_metadata_chars,
                "EPD_API_MAX_METADATA_CHARS",
                rule,
                f"metadata[{key[:32]!r}] has {longest} characters",
                per=" per key or value",
                field=field,
            )
            total += len(key.encode()) + len(value.encode())
        at_most(
            total,
            self.max_metadata_bytes,
            "EPD_API_MAX_METADATA_BYTES",
            rule,
            f"metadata holds {total} bytes",
            field=field,
        )

    def check_prompt(self, prompt: str | None, token_ids: list[int] | None) -> None:
        """A prompt of at most ``max_prompt_chars`` characters; at most ``context_tokens``
        token ids (the context holds no more, whatever ``max_tokens`` is)."""
        if prompt is not None:
            at_most(
                len(prompt),
                self.max_prompt_chars,
                "EPD_API_MAX_PROMPT_CHARS",
                "request.prompt",
                f"prompt has {len(prompt)} characters",
                field="prompt",
            )
        if token_ids is not None and len(token_ids) >= self.context_tokens:
            raise ValidationError(
                "context-length",
                f"{len(token_ids)} token ids leave no room in the context of "
                f"{self.context_tokens} tokens",
                field="token_ids",
            )

    def check_counts(self, images: int, videos: int) -> None:
        """At most ``max_images`` images and ``max_videos`` videos."""
        for n, most, what, setting in (
            (images, self.max_images, "image", "EPD_API_MAX_IMAGES"),
            (videos, self.max_videos, "video", "EPD_API_MAX_VIDEOS"),
        ):
            at_most(
                n, most, setting, f"{what}.count", f"{n} {what}s", modality=what, field=f"{what}s"
            )

    def check_submission(
        self,
        sampling: SamplingParams,
        cache_salt: Any,
        metadata: Mapping[str, Any] | None,
        deadline_s: float | None = None,
        *,
        sampling_checked: bool = False,
    ) -> None:
        """What the intake checks of every submission before rendering it (the sampling
        parameters unless its front checked them: ``sampling_checked``)."""
        if not sampling_checked:
            self.check_sampling_params(sampling)
        self.check_cache_salt(cache_salt)
        self.check_metadata(metadata)
        self.check_deadline(deadline_s)

    # -------------------------------------------------------------- once the tokens are known

    def check_event(self, ev: RenderEvent, *, counted: bool = False) -> None:
        """A rendered request, before anything of it is stored or sent: items per modality
        (unless its front counted them in the body: ``counted``), item labels, every token id
        inside the vocabulary, prompt + ``max_tokens`` inside the context."""
        if not counted:
            counts = {m: len(h) for m, h in ev.features.mm_hashes.items()}
            self.check_counts(counts.get("image", 0), counts.get("video", 0))
        for modality, index, label in ev.features.items():
            at_most(
                len(label),
                self.max_id_chars,
                "EPD_API_MAX_ID_CHARS",
                "request.mm_hash",
                f"the item's mm_hash has {len(label)} characters",
                modality=modality,
                item=index,
                field="features.mm_hashes",
            )
        self.check_tokens(ev.token_ids, ev.sampling.max_tokens)

    def check_tokens(self, token_ids: list[int], max_tokens: int) -> None:
        """Rules ``render.token_ids`` (every id in ``[0, vocab)``: on CUDA an id outside the
        embedding table kills the worker) and ``context-length``."""
        outside = outside_vocabulary(token_ids, self.vocab_size)
        if outside is not None:
            index, detail = outside
            raise ValidationError("render.token_ids", detail, field="token_ids", item=index)
        overflow = context_overflow(len(token_ids), max_tokens, self.context_tokens)
        if overflow is not None:
            raise ValidationError("context-length", overflow, field="token_ids")

    # ------------------------------------------------------------ a record read from a topic

    def check_prefill(self, ev: PrefillEvent) -> None:
        """What a prefill (or decode) worker holds an event to before any tensor is built, in
        the order the door checks a request: the prompt's length (:meth:`check_prompt`), the
        sampling parameters (:meth:`check_sampling_params`, ``max_tokens`` among them), then
        the tokens (:meth:`check_tokens`). The door's own checks, rules and messages, so a
        record written straight to a topic is refused exactly as the door refuses it."""
        self.check_prompt(None, ev.token_ids)
        self.check_sampling_params(ev.sampling)
        self.check_tokens(ev.token_ids, ev.sampling.max_tokens)
