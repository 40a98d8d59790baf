"""Failure classification, backoff, and the ErrorInfo a dead letter carries."""

from __future__ import annotations

import random

from schemas.errors import CodecError, ComputeError, ValidationError
from schemas.types import ErrorInfo

MAX_MESSAGE_CHARS = 2000


class Poison(Exception):
    """A permanent failure: the event goes to the DLQ now, without retries.

    Raise it from a handler with a code (``expired``, ``rejected``, ...) and, where it applies, the
    rule/modality/item/field, or wrap an existing :class:`ErrorInfo` with ``info=``.
    """

    def __init__(
        self,
        message: str = "",
        *,
        code: str = "poison",
        rule: str | None = None,
        modality: str | None = None,
        item: int | None = None,
        field: str | None = None,
        info: ErrorInfo | None = None,
    ) -> None:
        self.info = info or ErrorInfo(
            code=code, message=message, rule=rule, modality=modality, item=item, field=field
        )
        super().__init__(self.info.message or self.info.code)


class Transient(Exception):
    """A failure worth retrying with backoff (the default for unknown exceptions, too)."""


PERMANENT: tuple[type[BaseException], ...] = (Poison, CodecError, ValidationError, ComputeError)
"""Exception types never retried: retrying cannot change a bad payload."""


def default_is_transient(exc: BaseException) -> bool:
    """Whether to retry ``exc``.

    Permanent: :class:`Poison`, ``CodecError``, ``ValidationError``, ``ComputeError`` (inputs the
    model cannot take: the same inputs fail the same way). Everything else is retried
    up to ``max_attempts`` (store or broker outages: StoreUnavailable, KafkaError,
    ConnectionError, TimeoutError; and unknown errors, which then land in the DLQ).
    """
    return not isinstance(exc, PERMANENT)


def backoff_delay(attempt: int, initial_s: float, max_s: float) -> float:
    """Delay before retry number ``attempt`` (1-based): exponential, capped, jittered to 50-100%
    so a fleet of consumers does not retry in lockstep."""
    base = min(max_s, initial_s * (2 ** max(0, attempt - 1)))
    return base * random.uniform(0.5, 1.0)


def _clip(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 3] + "..."


def error_info(exc: BaseException, *, code: str | None = None) -> ErrorInfo:
    """The ErrorInfo describing ``exc``; validation errors keep their rule/modality/item/field."""
    if isinstance(exc, Poison):
        info = exc.info
        if code is not None and info.code == "poison":
            info = ErrorInfo(
                code=code,
                message=info.message,
                rule=info.rule,
                modality=info.modality,
                item=info.item,
                field=info.field,
            )
        return info
    if isinstance(exc, ValidationError):
        return ErrorInfo(
            code=code or "validation",
            message=_clip(exc.detail),
            rule=exc.rule,
            modality=exc.modality,
            item=exc.item,
            field=exc.field,
        )
    if isinstance(exc, CodecError):
        return ErrorInfo(code=code or "undecodable", message=_clip(str(exc)))
    if isinstance(exc, ComputeError):
        return ErrorInfo(code=code or "compute", message=_clip(str(exc)))
    return ErrorInfo(code=code or "handler_error", message=_clip(f"{type(exc).__name__}: {exc}"))
