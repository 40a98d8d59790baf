"""Which failures are retried, and how they are described in dead letters."""

from __future__ import annotations

import pytest

from consumers.retry import Poison, default_is_transient, error_info
from runtime.stores.base import StoreUnavailable
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
