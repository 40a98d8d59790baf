"""Every bound a request is held to at the door, from the settings and the model: one home.

The HTTP routes (native, vLLM and OpenAI-compatible), the intake and ``/openapi.json``
read the same :class:`RequestLimits`, built once from the settings and the model's render
info (vocabulary, context), so what is documented, what is refused at the door and what the
workers refuse agree. Each check raises ``schemas.errors.ValidationError`` naming its rule and
field; rules that mean "send less" are answered 413 by the API, the others 422.

What the door cannot know (an embedding that never arrives, a deadline passing in a queue)
stays the workers' to report.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from schemas.errors import ValidationError
from schemas.values import is_int, is_number

if TYPE_CHECKING:
    from runtime.settings import Settings
    from schemas.types import RenderEvent, SamplingParams

MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-3
"""Smallest temperature that samples: below it the logits over the temperature overflow (a
temperature of 0 is greedy). The prefill workers hold requests to the same value."""
INT32_MAX = 2**31 - 1
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


def _number(value: Any) -> bool:
    return is_number(value)


def _finite(value: Any) -> bool:
    return _number(value) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return is_int(value)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one deployment accepts per request; see the settings named on each field."""

    max_tokens: int
    """``EPD_MAX_TOKENS_LIMIT``: largest ``max_tokens``."""
    context_tokens: int
    """Prompt tokens + ``max_tokens``: the model's context (``EPD_MAX_CONTEXT_TOKENS``)."""
    vocab_size: int
    """Every token id is below this (the model's vocabulary)."""
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
    max_stop_strings: int = 16
    """``EPD_MAX_STOP_STRINGS``: stop strings per request (the workers' bound too)."""
    max_stop_string_chars: int = 256
    """``EPD_MAX_STOP_STRING_CHARS``: characters of one stop string."""
    max_stop_token_ids: int = 64
    """``EPD_MAX_STOP_TOKEN_IDS``: stop token ids per request (the workers' bound too)."""
    max_messages: int = 256
    """``EPD_API_MAX_MESSAGES``: messages of a chat request (input items of a response)."""
    max_message_parts: int = 64
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

    def check_sampling(
        self,
        max_tokens: Any,
        temperature: Any,
        *,
        top_p: Any = None,
        top_k: Any = None,
        seed: Any = None,
        stop: Any = None,
        stop_token_ids: Any = None,
        prefix: str = "",
    ) -> None:
        """The sampling parameters as the prefill workers will take them (the same settings,
        the same bounds), each refused naming its field:

        ``max_tokens`` an integer (not a boolean) in ``[1, EPD_MAX_TOKENS_LIMIT]``;
        ``temperature`` a finite number in ``[0, 2]``, 0 (greedy) or at least
        ``MIN_TEMPERATURE``; ``top_p`` in ``(0, 1]``; ``top_k`` an integer >= 0 (0: off);
        ``seed`` a 64-bit integer; at most ``EPD_MAX_STOP_STRINGS`` ``stop`` strings of 1 to
        ``EPD_MAX_STOP_STRING_CHARS`` characters; at most ``EPD_MAX_STOP_TOKEN_IDS``
        ``stop_token_ids``, each inside the vocabulary.
        None leaves a parameter at its default."""
        self.check_max_tokens(max_tokens, field=f"{prefix}max_tokens")
        if temperature is not None:
            self._check_temperature(temperature, f"{prefix}temperature")
        if top_p is not None:
            field = f"{prefix}top_p"
            if not _finite(top_p) or not 0.0 < top_p <= 1.0:
                raise ValidationError(
                    "sampling.top_p", f"top_p is {top_p!r}; it must be in (0, 1]", field=field
                )
        if top_k is not None:
            if not _integer(top_k) or not 0 <= top_k <= INT32_MAX:
                raise ValidationError(
                    "sampling.top_k",
                    f"top_k is {top_k!r}; it must be an integer, 0 (off) or positive",
                    field=f"{prefix}top_k",
                )
        if seed is not None:
            if not _integer(seed) or not -(2**63) <= seed < 2**63:
                raise ValidationError(
                    "sampling.seed",
                    f"seed is {seed!r}; it must be a 64-bit integer",
                    field=f"{prefix}seed",
                )
        if stop is not None:
            self.check_stop(stop, f"{prefix}stop")
        if stop_token_ids is not None:
            field = f"{prefix}stop_token_ids"
            if not isinstance(stop_token_ids, list):
                raise ValidationError(
                    "sampling.stop_token_ids", "stop_token_ids must be a list", field=field
                )
            if len(stop_token_ids) > self.max_stop_token_ids:
                raise ValidationError(
                    "sampling.stop_token_ids",
                    f"stop_token_ids has {len(stop_token_ids)} ids; the limit is "
                    f"{self.max_stop_token_ids} (EPD_MAX_STOP_TOKEN_IDS)",
                    field=field,
                )
            for i, t in enumerate(stop_token_ids):
                if not _integer(t) or not 0 <= t < self.vocab_size:
                    raise ValidationError(
                        "sampling.stop_token_ids",
                        f"stop_token_ids[{i}] = {t!r} is outside the vocabulary "
                        f"[0, {self.vocab_size})",
                        field=field,
                        item=i,
                    )

    def check_sampling_params(self, s: SamplingParams, *, prefix: str = "") -> None:
        """:meth:`check_sampling` over a ``SamplingParams``."""
        self.check_sampling(
            s.max_tokens,
            s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            prefix=prefix,
        )

    def check_max_tokens(self, max_tokens: Any, field: str = "max_tokens") -> None:
        """An integer (not a boolean) in ``[1, EPD_MAX_TOKENS_LIMIT]``, as the workers allow."""
        if not _integer(max_tokens):
            raise ValidationError("request.schema", "max_tokens must be an integer", field=field)
        if not 1 <= max_tokens <= self.max_tokens:
            raise ValidationError(
                "max-tokens",
                f"max_tokens is {max_tokens}; it must be between 1 and {self.max_tokens} "
                "(EPD_MAX_TOKENS_LIMIT)",
                field=field,
            )

    def _check_temperature(self, temperature: Any, field: str) -> None:
        if not _finite(temperature):
            raise ValidationError(
                "sampling.temperature", "temperature must be a finite number", field=field
            )
        if not 0.0 <= temperature <= MAX_TEMPERATURE or 0 < temperature < MIN_TEMPERATURE:
            raise ValidationError(
                "sampling.temperature",
                f"temperature is {temperature}; it must be 0 (greedy) or between "
                f"{MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}",
                field=field,
            )

    def check_stop(self, stop: Any, field: str = "stop") -> None:
        """At most ``EPD_MAX_STOP_STRINGS`` strings, each 1 to ``EPD_MAX_STOP_STRING_CHARS``
        characters (a single string counts as one)."""
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) for x in stops):
            raise ValidationError(
                "sampling.stop", "stop must be a string or a list of strings", field=field
            )
        if len(stops) > self.max_stop_strings:
            raise ValidationError(
                "sampling.stop",
                f"stop has {len(stops)} strings; the limit is {self.max_stop_strings} "
                "(EPD_MAX_STOP_STRINGS)",
                field=field,
            )
        for i, text in enumerate(stops):
            if not 1 <= len(text) <= self.max_stop_string_chars:
                raise ValidationError(
                    "sampling.stop",
                    f"stop[{i}] has {len(text)} characters; it must have 1 to "
                    f"{self.max_stop_string_chars} (EPD_MAX_STOP_STRING_CHARS)",
                    field=field,
                    item=i,
                )

    def check_chat_counts(self, messages: int, parts: int, where: str = "messages") -> None:
        """At most ``EPD_API_MAX_MESSAGES`` messages and ``EPD_API_MAX_MESSAGE_PARTS``
        content parts in any one of them (counted before any is parsed)."""
        if messages > self.max_messages:
            raise ValidationError(
                "request.messages",
                f"{messages} messages; the limit is {self.max_messages} (EPD_API_MAX_MESSAGES)",
                field=where,
            )
        if parts > self.max_message_parts:
            raise ValidationError(
                "request.messages",
                f"a message has {parts} content parts; the limit is {self.max_message_parts} "
                "(EPD_API_MAX_MESSAGE_PARTS)",
                field=where,
            )

    def check_deadline(self, deadline_s: Any, field: str = "deadline_s") -> None:
        """A deadline in seconds from now: a finite number in ``(0, 86400]``."""
        if deadline_s is None:
            return
        if not _number(deadline_s) or not math.isfinite(deadline_s):
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
        if len(salt) > self.max_cache_salt_chars:
            raise ValidationError(
                "request.cache_salt",
                f"cache_salt has {len(salt)} characters; the limit is "
                f"{self.max_cache_salt_chars} (EPD_API_MAX_CACHE_SALT_CHARS)",
                field=field,
            )

    def check_id(self, value: Any, field: str, rule: str = "request.request_id") -> None:
        """A client-given id: a non-empty string of at most ``max_id_chars`` (or none)."""
        if value is None:
            return
        if not isinstance(value, str) or not value:
            raise ValidationError("request.schema", f"{field} must be a string", field=field)
        if len(value) > self.max_id_chars:
            raise ValidationError(
                rule,
                f"{field} has {len(value)} characters; the limit is {self.max_id_chars} "
                "(EPD_API_MAX_ID_CHARS)",
                field=field,
            )

    def check_metadata(self, metadata: Mapping[str, Any] | None) -> None:
        """At most ``max_metadata_keys`` string labels, each key and value at most
        ``max_metadata_chars``, all together at most ``max_metadata_bytes`` (UTF-8)."""
        if metadata is None:
            return
        if len(metadata) > self.max_metadata_keys:
            raise ValidationError(
                "request.metadata",
                f"metadata has {len(metadata)} keys; the limit is {self.max_metadata_keys} "
                "(EPD_API_MAX_METADATA_KEYS)",
                field="metadata",
            )
        total = 0
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValidationError(
                    "request.schema", "metadata keys and values must be strings", field="metadata"
                )
            longest = max(len(key), len(value))
            if longest > self.max_metadata_chars:
                raise ValidationError(
                    "request.metadata",
                    f"metadata[{key[:32]!r}] has {longest} characters; the limit is "
                    f"{self.max_metadata_chars} per key or value (EPD_API_MAX_METADATA_CHARS)",
                    field="metadata",
                )
            total += len(key.encode()) + len(value.encode())
        if total > self.max_metadata_bytes:
            raise ValidationError(
                "request.metadata",
                f"metadata holds {total} bytes; the limit is {self.max_metadata_bytes} "
                "(EPD_API_MAX_METADATA_BYTES)",
                field="metadata",
            )

    def check_prompt(self, prompt: str | None, token_ids: list[int] | None) -> None:
        """A prompt of at most ``max_prompt_chars`` characters; at most ``context_tokens``
        token ids (the context holds no more, whatever ``max_tokens`` is)."""
        if prompt is not None and len(prompt) > self.max_prompt_chars:
            raise ValidationError(
                "request.prompt",
                f"prompt has {len(prompt)} characters; the limit is {self.max_prompt_chars} "
                "(EPD_API_MAX_PROMPT_CHARS)",
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
            if n > most:
                raise ValidationError(
                    f"{what}.count",
                    f"{n} {what}s; the limit is {most} ({setting})",
                    modality=what,
                    field=f"{what}s",
                )

    def check_submission(
        self,
        sampling: SamplingParams,
        cache_salt: Any,
        metadata: Mapping[str, Any] | None,
        deadline_s: float | None = None,
    ) -> None:
        """What the intake checks of every submission before rendering it."""
        self.check_sampling_params(sampling)
        self.check_cache_salt(cache_salt)
        self.check_metadata(metadata)
        self.check_deadline(deadline_s)

    # -------------------------------------------------------------- once the tokens are known

    def check_event(self, ev: RenderEvent) -> None:
        """A rendered request, before anything of it is stored or sent: items per modality,
        item labels, every token id inside the vocabulary, prompt + ``max_tokens`` inside the
        context."""
        counts = {m: len(h) for m, h in ev.features.mm_hashes.items()}
        self.check_counts(counts.get("image", 0), counts.get("video", 0))
        for modality, index, label in ev.features.items():
            if len(label) > self.max_id_chars:
                raise ValidationError(
                    "request.mm_hash",
                    f"the item's mm_hash has {len(label)} characters; the limit is "
                    f"{self.max_id_chars} (EPD_API_MAX_ID_CHARS)",
                    modality=modality,
                    item=index,
                    field="features.mm_hashes",
                )
        self.check_tokens(ev.token_ids, ev.sampling.max_tokens)

    def check_tokens(self, token_ids: list[int], max_tokens: int) -> None:
        """Rules ``render.token_ids`` (every id in ``[0, vocab)``: on CUDA an id outside the
        embedding table kills the worker) and ``context-length``."""
        vocab = self.vocab_size
        for i, t in enumerate(token_ids):
            if not is_int(t) or not 0 <= t < vocab:
                raise ValidationError(
                    "render.token_ids",
                    f"token_ids[{i}] = {t!r} is outside the vocabulary [0, {vocab})",
                    field="token_ids",
                    item=i,
                )
        if len(token_ids) + max_tokens > self.context_tokens:
            raise ValidationError(
                "context-length",
                f"{len(token_ids)} prompt tokens + max_tokens {max_tokens} exceed the context "
                f"of {self.context_tokens} tokens",
                field="token_ids",
            )
