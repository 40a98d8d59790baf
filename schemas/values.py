"""Small facts about values that several floors check: written once here, on the lowest one.

JSON's ``true`` is not the number 1, but Python's ``bool`` is an ``int``: every check of a
number from the wire goes through :func:`is_int` / :func:`is_number` (:func:`is_finite`). A
deadline is epoch milliseconds, passed once the clock reaches it (:func:`deadline_passed`).
"""

from __future__ import annotations

import math
from typing import Any, TypeGuard


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer and not a boolean."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether ``value`` is an integer or a float, and not a boolean (NaN and infinities are
    numbers here: callers that need finite ones say so)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    """Whether ``value`` is a number (:func:`is_number`) that is neither infinite nor NaN."""
    return is_number(value) and math.isfinite(value)


def deadline_passed(deadline_ms: int | None, now: int) -> TypeGuard[int]:
    """Whether a request's deadline (epoch ms; None: it has none) has passed at ``now`` (epoch
    ms: the caller reads its own clock, so a test can set it). True tells the type checker
    there was a deadline."""
    return deadline_ms is not None and now >= deadline_ms
