"""The value facts written once (``schemas/values.py``, ``schemas/vllm_sampling.py``) and the
sites that use them."""

from __future__ import annotations

import math

import pytest

from schemas.errors import ValidationError
from schemas.values import deadline_passed, is_int, is_number
from schemas.vllm_sampling import pipeline_top_k, sampling_from_vllm


@pytest.mark.parametrize(
    ("value", "integer", "number"),
    [
        (3, True, True),
        (0, True, True),
        (True, False, False),
        (False, False, False),
        (2.5, False, True),
        (math.nan, False, True),
        ("3", False, False),
        (None, False, False),
    ],
)
def test_a_boolean_is_neither_an_integer_nor_a_number(
    value: object, integer: bool, number: bool
) -> None:
    assert (is_int(value), is_number(value)) == (integer, number)


def test_a_deadline_passes_when_the_clock_reaches_it() -> None:
    assert not deadline_passed(None, 10**15)
    assert not deadline_passed(1000, 999)
    assert deadline_passed(1000, 1000) and deadline_passed(1000, 1001)


@pytest.mark.parametrize(("given", "ours"), [(-1, 0), (None, 0), (0, 0), (5, 5)])
def test_vllms_top_k_off_is_the_pipelines_zero(given: int | None, ours: int) -> None:
    assert pipeline_top_k(given) == ours
    params = {} if given is None else {"top_k": given}
    assert sampling_from_vllm(params).top_k == ours


@pytest.mark.parametrize("bad", [True, 1.0, "1"])
def test_vllm_stop_token_ids_are_integers_not_booleans(bad: object) -> None:
    with pytest.raises(ValidationError) as err:
        sampling_from_vllm({"stop_token_ids": [1, bad]})
    assert err.value.field == "stop_token_ids"
