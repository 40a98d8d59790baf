"""Which failures are retried, and how they are described in dead letters."""

from __future__ import annotations

import pytest
import redis.exceptions as redis_errors
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NodeNotReadyError,
)

from consumers.retry import (
    Poison,
    RetryPolicy,
    default_is_infrastructure,
    default_is_transient,
    error_info,
)
from runtime.stores.errors import StoreTimeout, StoreUnavailable
from schemas.errors import CodecError, ComputeError, ValidationError


@pytest.mark.parametrize(
    ("exc", "transient", "code"),
    [
        (ValidationError("ec-key", "bad key", modality="image", item=1), False, "validation"),
        (CodecError("truncated"), False, "undecodable"),
        (ComputeError("embeddings shape does not match"), False, "compute"),
        (Poison("expired", code="expired"), False, "expired"),
        (StoreUnavailable("redis down"), True, "handler_error"),
        (ConnectionError("broker down"), True, "handler_error"),
        (RuntimeError("unknown"), True, "handler_error"),
    ],
)
def test_classification(exc: Exception, transient: bool, code: str) -> None:
    assert default_is_transient(exc) is transient
    assert error_info(exc).code == code


def test_validation_error_keeps_its_location() -> None:
    info = error_info(ValidationError("ec-key", "bad key", modality="image", item=1, field="f"))
    assert (info.rule, info.modality, info.item, info.field) == ("ec-key", "image", 1, "f")


# --- the retry budget: outages for a time, handler errors for a count ---------------------------


@pytest.mark.parametrize(
    ("exc", "infra"),
    [
        (StoreUnavailable("redis down"), True),
        (redis_errors.ConnectionError("Connection refused"), True),
        (redis_errors.BusyLoadingError("loading the dataset"), True),
        (redis_errors.TimeoutError("read timed out"), True),
        (KafkaTimeoutError(), True),
        (KafkaConnectionError("no route"), True),
        (NodeNotReadyError(), True),
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        (StoreTimeout(["k"], 1.0), False),  # an embedding that never came: prefill reports it
        (MessageSizeTooLargeError(), False),  # not retriable: the record itself is too big
        (redis_errors.ResponseError("WRONGTYPE"), False),
        (RuntimeError("bug"), False),
        (ValidationError("tensor", "too big"), False),
        (Poison("x"), False),
    ],
)
def test_infrastructure_classification(exc: Exception, infra: bool) -> None:
    assert default_is_infrastructure(exc) is infra


POLICY = RetryPolicy(
    max_attempts=3,
    backoff_initial_s=0.2,
    backoff_max_s=5,
    transient_retry_s=30,
    transient_backoff_max_s=2,
)


def _outage(policy: RetryPolicy, seconds: float, *, deadline_left_s: float | None = None) -> int:
    """Tries a record gets while the store is down for ``seconds`` (a simulated clock)."""
    clock = 0.0
    failures = 0
    while clock < seconds:
        failures += 1
        d = policy.decide(
            permanent=False,
            infrastructure=True,
            handler_failures=0,
            infra_failures=failures,
            outage_s=clock,
            deadline_left_s=None if deadline_left_s is None else deadline_left_s - clock,
        )
        if not d.retry:
            return -failures
        clock += d.delay_s
    return failures


def test_a_five_second_outage_is_outlived_by_the_default_budget() -> None:
    # Before the budget: 3 tries with 0.1-0.2 s and 0.2-0.4 s pauses; a 5 s outage dead-lettered.
    tries = _outage(POLICY, 5.0)
    assert tries > POLICY.max_attempts  # more tries than handler errors get...
    assert tries > 0  # ...and it never gave up
    # pauses stay short (work resumes soon after the outage ends)
    for n in range(1, 50):
        d = POLICY.decide(
            permanent=False,
            infrastructure=True,
            handler_failures=0,
            infra_failures=n,
            outage_s=1.0,
        )
        assert d.retry and d.delay_s <= POLICY.transient_backoff_max_s


def test_an_outage_beyond_the_budget_is_dead_lettered_as_retries_exhausted() -> None:
    assert _outage(POLICY, 120.0) < 0
    d = POLICY.decide(
        permanent=False, infrastructure=True, handler_failures=0, infra_failures=40, outage_s=30.0
    )
    assert (d.retry, d.code) == (False, "retries_exhausted")


def test_the_last_pause_ends_at_the_budget_not_after_it() -> None:
    d = POLICY.decide(
        permanent=False,
        infrastructure=True,
        handler_failures=0,
        infra_failures=20,
        outage_s=29.9,
    )
    assert d.retry and d.delay_s == pytest.approx(0.1)


def test_the_deadline_caps_the_budget_and_a_passed_one_expires() -> None:
    d = POLICY.decide(
        permanent=False,
        infrastructure=True,
        handler_failures=0,
        infra_failures=10,
        outage_s=1.0,
        deadline_left_s=0.05,
    )
    assert d.retry and d.delay_s <= 0.05
    d = POLICY.decide(
        permanent=False,
        infrastructure=True,
        handler_failures=0,
        infra_failures=11,
        outage_s=1.05,
        deadline_left_s=-0.01,
    )
    assert (d.retry, d.code) == (False, "expired")
    # a generous deadline does not extend the budget
    assert _outage(POLICY, 120.0, deadline_left_s=600.0) < 0


def test_handler_errors_keep_their_attempt_count() -> None:
    for n, retry in ((1, True), (2, True), (3, False)):
        d = POLICY.decide(
            permanent=False,
            infrastructure=False,
            handler_failures=n,
            infra_failures=0,
            outage_s=0.0,
        )
        assert d.retry is retry
    assert d.code == "retries_exhausted"
    # outage tries before a handler error do not use up its attempts
    d = POLICY.decide(
        permanent=False, infrastructure=False, handler_failures=1, infra_failures=9, outage_s=4.0
    )
    assert d.retry


def test_permanent_errors_are_not_retried() -> None:
    d = POLICY.decide(
        permanent=True, infrastructure=False, handler_failures=0, infra_failures=0, outage_s=0.0
    )
    assert (d.retry, d.code) == (False, None)
