"""The sampling bounds of a request: ``max_tokens``, temperature, the draw (``top_p``,
``top_k``, ``seed``) and the stop conditions, checked as the prefill workers take them.

:class:`SamplingLimits` is the part of :class:`runtime.request_limits.RequestLimits` that holds
these (``RequestLimits`` is one and adds the rest of a request's bounds): callers hold a
``RequestLimits``, the door and the workers alike, so each rule has one slug and one message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.bounds import at_most, outside_vocabulary
from schemas import defaults
from schemas.errors import ValidationError
from schemas.values import is_finite, is_int

if TYPE_CHECKING:
    from schemas.types import SamplingParams

MAX_TEMPERATURE = 2.0
MIN_TEMPERATURE = 1e-3
"""Smallest temperature that samples: below it the logits over the temperature overflow (a
temperature of 0 is greedy). The prefill workers hold requests to the same value."""
INT32_MAX = 2**31 - 1


def check_temperature(temperature: Any, field: str) -> None:
    """A finite number in ``[0, MAX_TEMPERATURE]``: 0 (greedy) or at least
    ``MIN_TEMPERATURE``."""
    if not is_finite(temperature):
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


def check_draw(top_p: Any, top_k: Any, seed: Any, prefix: str) -> None:
    """``top_p`` in ``(0, 1]``, ``top_k`` an integer >= 0 (0: off), ``seed`` a 64-bit
    integer; None leaves one at its default."""
    if top_p is not None and (not is_finite(top_p) or not 0.0 < top_p <= 1.0):
        raise ValidationError(
            "sampling.top_p", f"top_p is {top_p!r}; it must be in (0, 1]", field=f"{prefix}top_p"
        )
    if top_k is not None and (not is_int(top_k) or not 0 <= top_k <= INT32_MAX):
        raise ValidationError(
            "sampling.top_k",
            f"top_k is {top_k!r}; it must be an integer, 0 (off) or positive",
            field=f"{prefix}top_k",
        )
    if seed is not None and (not is_int(seed) or not -(2**63) <= seed < 2**63):
        raise ValidationError(
            "sampling.seed", f"seed is {seed!r}; it must be a 64-bit integer", field=f"{prefix}seed"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingLimits:
    """The sampling bounds of one deployment; see the settings named on each field."""

    max_tokens: int
    """``EPD_MAX_TOKENS_LIMIT``: largest ``max_tokens``."""
    vocab_size: int
    """Every token id is below this (the model's vocabulary)."""
    max_stop_strings: int = defaults.MAX_STOP_STRINGS
    """``EPD_MAX_STOP_STRINGS``: stop strings per request (the workers' bound too)."""
    max_stop_string_chars: int = defaults.MAX_STOP_STRING_CHARS
    """``EPD_MAX_STOP_STRING_CHARS``: characters of one stop string."""
    max_stop_token_ids: int = defaults.MAX_STOP_TOKEN_IDS
    """``EPD_MAX_STOP_TOKEN_IDS``: stop token ids per request (the workers' bound too)."""

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
            check_temperature(temperature, f"{prefix}temperature")
        check_draw(top_p, top_k, seed, prefix)
        if stop is not None:
            self.check_stop(stop, f"{prefix}stop")
        if stop_token_ids is not None:
            self.check_stop_token_ids(stop_token_ids, f"{prefix}stop_token_ids")

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
        if not is_int(max_tokens):
            raise ValidationError("request.schema", "max_tokens must be an integer", field=field)
        if not 1 <= max_tokens <= self.max_tokens:
            raise ValidationError(
                "max-tokens",
                f"max_tokens is {max_tokens}; it must be between 1 and {self.max_tokens} "
                "(EPD_MAX_TOKENS_LIMIT)",
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
        n, setting = len(stops), "EPD_MAX_STOP_STRINGS"
        at_most(
            n, self.max_stop_strings, setting, "sampling.stop", f"stop has {n} strings", field=field
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

    def check_stop_token_ids(self, stop_token_ids: Any, field: str = "stop_token_ids") -> None:
        """A list of at most ``EPD_MAX_STOP_TOKEN_IDS`` ids, each inside the vocabulary."""
        rule = "sampling.stop_token_ids"
        if not isinstance(stop_token_ids, list):
            raise ValidationError(rule, "stop_token_ids must be a list", field=field)
        n, setting = len(stop_token_ids), "EPD_MAX_STOP_TOKEN_IDS"
        at_most(
            n, self.max_stop_token_ids, setting, rule, f"stop_token_ids has {n} ids", field=field
        )
        outside = outside_vocabulary(stop_token_ids, self.vocab_size, "stop_token_ids")
        if outside is not None:
            index, detail = outside
            raise ValidationError(rule, detail, field=field, item=index)
