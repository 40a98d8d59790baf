"""Differential test: our ``vllm`` mode against vLLM 0.33's own code.

vLLM's code comes from ``tools/vllm-side.sh`` (its wheel's Python files; see
:mod:`tests.vllm_side`): skipped, saying so, where it is not assembled, and required in CI.

vLLM's verdict is what its endpoint does before scheduling: ``GenerateRequest`` validation,
the msgpack encoding of the transfer params, and decoding the features
(``mm_kwargs_from_features``). ``SamplingParams``' own field checks are not mirrored (see
``schemas/vllm_rules.py``), so the mutations below leave the inside of ``sampling_params`` alone.
"""

from __future__ import annotations

import json
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.vllm_side import use_vllm

use_vllm()

import msgspec  # noqa: E402
from vllm.entrypoints.scale_out.token_in_token_out.mm_features import (  # noqa: E402
    mm_kwargs_from_features,
)
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest  # noqa: E402

from schemas.errors import ValidationError  # noqa: E402
from schemas.vllm_rules import check_vllm_request  # noqa: E402
from tests.unit import test_gate_properties as props  # noqa: E402
from tests.unit import test_safety_gate as cases  # noqa: E402


def vllm_accepts(body: Any) -> bool:
    """vLLM's own verdict on a body (any exception before scheduling is a rejection)."""
    try:
        req = GenerateRequest.model_validate(body)
        msgspec.msgpack.encode(
            (req.sampling_params, req.kv_transfer_params, req.ec_transfer_params)
        )
        if req.features is not None and not req.content_parts:
            mm_kwargs_from_features(req.features)
    except Exception:
        return False
    return True


def ours_accepts(body: Any) -> bool:
    try:
        check_vllm_request(body)
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize("name", sorted(cases.ACCEPTED))
def test_accepted_cases_agree(name: str) -> None:
    body = cases.ACCEPTED[name]()
    assert vllm_accepts(body) and ours_accepts(body)


@pytest.mark.parametrize("name", sorted(cases.REJECTED))
def test_rejected_cases_agree(name: str) -> None:
    body = cases.REJECTED[name][0]()
    assert not vllm_accepts(body) and not ours_accepts(body)


@st.composite
def mutated(draw: st.DrawFn) -> Any:
    body = json.loads(draw(st.sampled_from(props.BASES)))
    for _ in range(draw(st.integers(1, 3))):
        paths = [
            p
            for p in props._paths(body)
            if (p[:1] != ("token_ids",) or p[1:] in ((), (0,)))
            and (p[:1] != ("sampling_params",) or p == ("sampling_params",))
        ]
        path = draw(st.sampled_from(paths))
        body = props._replace(body, path, draw(props.json_values | props._item_docs()))
    return body


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_random_mutations_agree(body: Any) -> None:
    assert ours_accepts(body) == vllm_accepts(body), json.dumps(body)[:2000]


def _raw(b: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(3, b)


_DTYPES = "int64 float32 bfloat16 bool uint8 float64 qint8 float8_e4m3fn complex64 int4 float"
_dtypes = st.sampled_from([*_DTYPES.split(), "long", "Tensor", "__class__", "nope", "uint64"])
_dims = st.lists(st.integers(-2, 4) | st.booleans() | st.floats(0, 2), max_size=3)
_tensor = st.tuples(
    _dtypes,
    _dims | props.msgpack_values,
    st.builds(_raw, st.binary(max_size=32))
    | st.binary(max_size=32)
    | st.integers(-1, 2)
    | st.none(),
).map(list)
_nested = st.recursive(
    _tensor | st.integers(-3, 3) | st.floats(allow_nan=True) | st.booleans() | st.none(),
    lambda inner: st.lists(inner, max_size=3),
    max_leaves=4,
)
_kw_keys = st.sampled_from(
    ["keep_on_cpu", "slices", "dim", "batch_size", "size_per_item", "modality", "x"]
)
_spec = st.tuples(
    st.sampled_from(["batched", "flat", "shared", "flat_from_sizes", "dummy", "__init__"]),
    st.dictionaries(
        _kw_keys,
        st.booleans()
        | st.integers(-1, 3)
        | st.lists(st.lists(st.integers(0, 4) | st.none(), max_size=4), max_size=2)
        | st.lists(st.integers(0, 4) | st.none(), max_size=4)
        | st.builds(_raw, st.binary(max_size=8)),
        max_size=3,
    ),
).map(list)
_elem = st.fixed_dictionaries({"data": _nested, "field": _spec}) | props.msgpack_values


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.text(max_size=4), _elem, min_size=1, max_size=2))
def test_random_items_agree(doc: dict[str, Any]) -> None:
    body = json.loads(props.BASES[1])
    body["features"]["mm_metadata"]["image"][0] = props._b64(doc)
    assert ours_accepts(body) == vllm_accepts(body), repr(doc)[:2000]
