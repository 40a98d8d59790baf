"""Failure classification, the retry policy, backoff, and the ErrorInfo a dead letter carries.

Two kinds of retryable failure are budgeted differently (:class:`RetryPolicy`):

* **Infrastructure** (:func:`default_is_infrastructure`: the store or the broker cannot be
  reached or timed out). The event is fine; the world around it is not. A Redis restart or a
  broker failover lasts seconds, so these are retried for a *time* budget
  (``EPD_TRANSIENT_RETRY_S``, capped by the event's deadline), however many tries that takes.
* **Handler errors** (anything else not permanent): retried ``max_attempts`` times in total,
  because an error that is not about reachability usually repeats.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import redis.exceptions as redis_errors
from aiokafka.errors import KafkaError, KafkaTimeoutError

from runtime.stores.errors import StoreTimeout, StoreUnavailable
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
    model cannot take: the same inputs fail the same way). Everything else is retried: store or
    broker outages (:func:`default_is_infrastructure`) for a time budget, unknown errors up to
    ``max_attempts`` (then they land in the DLQ); see :class:`RetryPolicy`.
    """
    return not isinstance(exc, PERMANENT)


_INFRASTRUCTURE: tuple[type[BaseException], ...] = (
    StoreUnavailable,
    redis_errors.ConnectionError,  # BusyLoadingError (a Redis loading after a restart) is one
    redis_errors.TimeoutError,
    # A Redis Cluster while a master is down, a failover runs or a slot moves:
    redis_errors.ClusterError,  # ClusterDownError, MasterDownError, "TTL exhausted"
    redis_errors.TryAgainError,
    redis_errors.SlotNotCoveredError,
    KafkaTimeoutError,  # a send the broker did not acknowledge in time (not flagged retriable)
    ConnectionError,
)


def default_is_infrastructure(exc: BaseException) -> bool:
    """Whether ``exc`` says a store or the broker is unreachable (not that the event is bad).

    StoreUnavailable, redis-py connection and timeout errors (and a Redis Cluster's while it
    fails over or moves a slot), aiokafka errors flagged
    ``retriable`` (no leader, node not ready, request timed out, ...) and send timeouts, and
    the builtin ConnectionError and TimeoutError. Not :class:`StoreTimeout`: an embedding that
    never arrived is an outcome the prefill worker reports, not an outage.
    """
    if isinstance(exc, (*PERMANENT, StoreTimeout)):
        return False
    if isinstance(exc, _INFRASTRUCTURE):
        return True
    if isinstance(exc, KafkaError):
        return bool(getattr(exc, "retriable", False))
    return isinstance(exc, TimeoutError)


@dataclass(frozen=True, slots=True)
class RetryDecision:
    """What to do after a failed try: retry after ``delay_s``, or give up with ``code``."""

    retry: bool
    delay_s: float = 0.0
    code: str | None = None
    """The dead letter's error code when giving up (None: the error's own code)."""


GIVE_UP = RetryDecision(retry=False)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long a consume loop keeps trying one record (pure: time is passed in).

    ``max_attempts`` bounds handler errors; ``transient_retry_s`` bounds infrastructure failures,
    counted from the record's first one and never past its deadline. Infrastructure backoff grows
    from ``backoff_initial_s`` to ``transient_backoff_max_s`` (short, so work resumes within about
    that long of the outage ending) and never overshoots the budget.
    """

    max_attempts: int = 3
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 5.0
    transient_retry_s: float = 30.0
    transient_backoff_max_s: float = 2.0

    def decide(
        self,
        *,
        permanent: bool,
        infrastructure: bool,
        handler_failures: int,
        infra_failures: int,
        outage_s: float,
        deadline_left_s: float | None = None,
    ) -> RetryDecision:
        """Retry or give up after a failure.

        ``handler_failures``/``infra_failures``: failures of each kind so far, this one included;
        ``outage_s``: seconds since the record's first infrastructure failure;
        ``deadline_left_s``: seconds until the event's deadline (None: it has none).
        """
        if permanent:
            return GIVE_UP
        if not infrastructure:
            if handler_failures >= self.max_attempts:
                return RetryDecision(retry=False, code="retries_exhausted")
            delay = backoff_delay(handler_failures, self.backoff_initial_s, self.backoff_max_s)
            return RetryDecision(retry=True, delay_s=delay)
        left = self.transient_retry_s - outage_s
        if deadline_left_s is not None and deadline_left_s < left:
            if deadline_left_s <= 0:
                return RetryDecision(retry=False, code="expired")
            left = deadline_left_s
        if left <= 0:
            return RetryDecision(retry=False, code="retries_exhausted")
        delay = backoff_delay(infra_failures, self.backoff_initial_s, self.transient_backoff_max_s)
        return RetryDecision(retry=True, delay_s=min(delay, left))


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
