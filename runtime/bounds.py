"""The wording of a request bound, written once: a count or length over its limit
(:func:`at_most`), a token id outside the vocabulary (:func:`outside_vocabulary`), a prompt past
the context (:func:`context_overflow`).

:class:`runtime.request_limits.RequestLimits` words every check with these, and so do the fronts
that cannot hold one (the renderer's token ids, the compute guard), so one rule reads the same
wherever it is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schemas.errors import ValidationError
from schemas.values import is_int


def at_most(
    n: int, limit: int, setting: str, rule: str, counted: str, per: str = "", **where: Any
) -> None:
    """Every count and length bound, in one wording: ``counted`` (what was given, ``n`` said
    in it) "; the limit is" ``limit`` ``per`` "(" ``setting`` ")", refused as ``rule`` at
    ``where`` (field, item, modality) when ``n`` is above ``limit``."""
    if n > limit:
        raise ValidationError(rule, f"{counted}; the limit is {limit}{per} ({setting})", **where)


def outside_vocabulary(
    token_ids: Sequence[Any], vocab_size: int, name: str = "token_ids"
) -> tuple[int, str] | None:
    """The first token id that is not an integer in ``[0, vocab_size)``, as (its index, the
    one wording of the vocabulary rules, ``name`` the list's field); None when every id is
    inside. On CUDA an id outside the embedding table is a device-side assert that kills the
    worker, so every front (the door, the renderer, the prefill workers, the compute guard)
    asks this."""
    for i, t in enumerate(token_ids):
        if not is_int(t) or not 0 <= t < vocab_size:
            return i, f"{name}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})"
    return None


def context_overflow(prompt_tokens: int, max_tokens: int, context: int) -> str | None:
    """The wording of rule ``context-length`` when ``prompt_tokens`` + ``max_tokens`` exceed
    ``context``; None when they fit."""
    if prompt_tokens + max_tokens <= context:
        return None
    return (
        f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} exceed the context "
        f"of {context} tokens"
    )
