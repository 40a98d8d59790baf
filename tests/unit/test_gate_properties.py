"""Property-based tests of the safety gate.

- The per-item rule: random feature sets (modalities, items, full data / grid-only data /
  none, metadata present or absent, EC entries good / empty / falsy / absent, both connector
  shapes) judged by the validator, in both modes and through the JSON path, against a small
  reference written here from the rule's wording.
- ``epd validate`` never prints a traceback: random bytes, deep nesting, huge numbers, wrong
  types, and random mutations of valid requests, including of the msgpack inside an item.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd.cli import main
from runtime.settings import get_settings
from schemas.errors import ValidationError
from schemas.types import Features, ItemData, PlaceholderRange
from schemas.validator import ValidationConfig, validate_features
from schemas.vllm_wire import features_to_json, validate_request_json
from tests.unit.test_vllm_wire import make_render

STRICT = ValidationConfig()
VLLM = ValidationConfig(mode="vllm")
ROOT = Path(__file__).resolve().parents[2]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --------------------------------------------------------------------------- the per-item rule

KW_KINDS = ("full", "grid_only", None)
ENTRY_KINDS = ("good", "empty", "false", "null", "hash_only", "absent")


def _data(modality: str, kind: str | None, *, meta: bool = False) -> dict[str, Any] | None:
    """Item tensors of one kind; every kind of an item agrees on its grid (4 embeddings)."""
    if kind is None:
        return None
    if modality == "audio":
        lengths = {"audio_feature_lengths": torch.tensor([4])}
        return (
            lengths if kind != "full" or meta else {"input_features": torch.ones(4, 2), **lengths}
        )
    name = "image_grid_thw" if modality == "image" else "video_grid_thw"
    g = {name: torch.tensor([1, 4, 4])}
    if kind != "full" or meta:
        return g
    pv = "pixel_values" if modality == "image" else "pixel_values_videos"
    return {pv: torch.ones(16, 3), **g}


def _entry(kind: str, h: str, shape: str) -> Any:
    """The entry of one kind for ``h`` (``absent`` is handled by the caller)."""
    good = {"key": f"ec:fp:{h}", "store": "redis://x"}
    if shape == "ec_items":
        return {"mm_hash": h, **good} if kind == "good" else {"mm_hash": h}
    return {
        "good": good,
        "empty": {},
        "false": False,
        "null": None,
        "hash_only": {"mm_hash": h},
    }[kind]


item_spec = st.tuples(st.sampled_from(KW_KINDS), st.booleans(), st.sampled_from(ENTRY_KINDS))
feature_sets = st.tuples(
    st.dictionaries(
        st.sampled_from(("image", "video", "audio")),
        st.lists(item_spec, min_size=0, max_size=3),
        min_size=1,
        max_size=3,
    ),
    st.sampled_from(("map", "ec_items")),
    st.booleans(),  # null kwargs_data / mm_metadata when no item has any
)


def build(spec: Any) -> tuple[list[int], Features, dict[str, Any], list[tuple[Any, ...]]]:
    """Features, params and the flat item list (modality, index, kw, meta, entry kind)."""
    modalities, shape, null_slots = spec
    items: list[tuple[Any, ...]] = []
    hashes: dict[str, list[str]] = {}
    places: dict[str, list[PlaceholderRange]] = {}
    kwargs: dict[str, list[ItemData | None]] = {}
    metas: dict[str, list[ItemData | None]] = {}
    params: dict[str, Any] = {}
    listed: list[Any] = []
    offset = 1
    for modality, specs in modalities.items():
        hashes[modality], places[modality] = [], []
        kwargs[modality], metas[modality] = [], []
        for i, (kw, meta, entry) in enumerate(specs):
            h = f"{modality}-{i}"
            hashes[modality].append(h)
            places[modality].append(PlaceholderRange(offset, 4))
            offset += 5
            kwargs[modality].append(_data(modality, kw))
            metas[modality].append(_data(modality, "meta", meta=True) if meta else None)
            if shape == "ec_items" and entry in ("false", "null"):
                entry = "absent"  # a list entry is a map naming its mm_hash, or nothing
            if entry != "absent":
                e = _entry(entry, h, shape)
                if shape == "ec_items":
                    listed.append(e)
                else:
                    params[h] = e
            items.append((modality, i, kw, meta, entry))
    if shape == "ec_items" and listed:
        params = {"ec_items": listed}
    any_kw = any(x is not None for v in kwargs.values() for x in v)
    any_meta = any(x is not None for v in metas.values() for x in v)
    f = Features(
        mm_hashes=hashes,
        mm_placeholders=places,
        kwargs_data=kwargs if any_kw or not null_slots else None,
        mm_metadata=metas if any_meta or not null_slots else None,
    )
    return list(range(offset + 1)), f, params, items


def reference_strict(items: list[tuple[Any, ...]]) -> tuple[str, str, int] | None:
    """The rule as worded: an item without its own entry must carry its encoder inputs; an
    entry that is there must locate an embedding (non-empty, more than its mm_hash)."""
    for modality, i, kw, _meta, entry in items:
        if entry in ("absent", "null"):
            if kw != "full":
                return ("ec-transfer-required", modality, i)
        elif entry != "good":
            return ("ec-entry", modality, i)
    return None


def reference_vllm(
    items: list[tuple[Any, ...]], params: dict[str, Any]
) -> tuple[str, str, int] | None:
    """vLLM: metadata without data needs a non-empty ec_transfer_params, whatever it holds."""
    if params:
        return None
    for modality, i, kw, meta, _entry in items:
        if meta and kw is None:
            return ("ec-transfer-required", modality, i)
    return None


def verdict(fn: Any, *args: Any) -> tuple[str, str | None, int | None] | None:
    try:
        fn(*args)
    except ValidationError as e:
        return (e.rule, e.modality, e.item)
    return None


@SETTINGS
@given(feature_sets)
def test_per_item_rule_matches_reference(spec: Any) -> None:
    tokens, f, params, items = build(spec)
    want_strict, want_vllm = reference_strict(items), reference_vllm(items, params)
    assert verdict(validate_features, tokens, f, params, STRICT) == want_strict
    assert verdict(validate_features, tokens, f, params, VLLM) == want_vllm
    # The same request as vLLM JSON: vLLM's rules first, then ours.
    body = {
        "token_ids": tokens,
        "features": features_to_json(f),
        "sampling_params": {},
        "ec_transfer_params": json.loads(json.dumps(params)),
    }
    assert verdict(validate_request_json, body, VLLM) == want_vllm
    assert verdict(validate_request_json, body, STRICT) == (want_vllm or want_strict)


# --------------------------------------------------------------------------- epd validate fuzz

_ANY_CHAR = st.characters(exclude_categories=())  # lone surrogates too: JSON can carry them
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.text(_ANY_CHAR, max_size=3),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.text(_ANY_CHAR, max_size=2), inner, max_size=4)
    ),
    max_leaves=20,
)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.binary(max_size=24)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=24)),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.integers(0, 3), inner, max_size=4)
    ),
    max_leaves=20,
)


def _b64(doc: Any) -> str:
    return base64.b64encode(msgpack.packb(doc, use_bin_type=True)).decode()


def _item_docs() -> st.SearchStrategy[str]:
    """Items near valid ones: a field's data or spec replaced, or a random document."""
    good = ["int64", [3], msgpack.ExtType(3, b"\x01" * 24)]
    near = st.builds(
        lambda data, spec: {"image_grid_thw": {"data": data, "field": spec}},
        st.just(good) | msgpack_values | st.lists(msgpack_values, min_size=3, max_size=3),
        st.just(["batched", {"keep_on_cpu": True}])
        | msgpack_values
        | st.tuples(st.sampled_from(["batched", "flat", "shared", "x"]), msgpack_values).map(list),
    )
    return (near | msgpack_values).map(_b64)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    obj[path[0]] = _replace(obj[path[0]], path[1:], value)
    return obj


def _bases() -> list[dict[str, Any]]:
    meta_only = make_render(video_meta=True)
    meta_only["features"]["kwargs_data"] = None
    meta_only["ec_transfer_params"] = {
        h: {"key": f"ec:fp:{h}", "store": "s"} for h in ("img-a", "img-b", "vid-a")
    }
    return [make_render(omit_empty_modality=False), meta_only]


BASES = [json.dumps(b) for b in _bases()]


@st.composite
def mutated_requests(draw: st.DrawFn) -> str:
    body = json.loads(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        # token_ids would take most draws; one of its elements stands for all
        paths = [p for p in _paths(body) if p[:1] != ("token_ids",) or p[1:] in ((), (0,))]
        path = draw(st.sampled_from(paths))
        body = _replace(body, path, draw(json_values | _item_docs()))
    return json.dumps(body)


def _nested(depth: int, kind: str) -> str:
    if kind == "list":
        return "[" * depth + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


inputs = st.one_of(
    st.binary(max_size=200),
    json_values.map(json.dumps),
    mutated_requests(),
    st.builds(_nested, st.integers(0, 3000), st.sampled_from(["list", "map"])),
    st.builds(
        lambda d: json.dumps({"token_ids": [1], "sampling_params": {}}).replace("1", "1" * d),
        st.integers(1, 6000),
    ),
)

_TMP = tempfile.mkdtemp(prefix="epd-fuzz-")


def run_validate(data: str | bytes, mode: str) -> tuple[int, str]:
    path = os.path.join(_TMP, "in.json")
    with open(path, "wb") as fh:
        fh.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["validate", "--mode", mode, path])
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture(autouse=True)
def _settings(monkeypatch: pytest.MonkeyPatch) -> Any:
    for var in ("EPD_EC_SECRET", "EPD_VALIDATION_MODE", "EPD_SPATIAL_MERGE_SIZE"):
        monkeypatch.delenv(var, raising=False)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(inputs, st.sampled_from(["strict", "vllm"]))
def test_validate_never_prints_a_traceback(data: str | bytes, mode: str) -> None:
    rc, text = run_validate(data, mode)
    assert rc in (0, 1, 2)
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text and "bug" not in text, text
    assert lines[0].startswith(("ok", "rejected: rule=", "error: cannot read JSON")), text
    assert (rc == 0) == (lines[0] == "ok")


@pytest.mark.parametrize(
    "data",
    [
        b"\xff\xfe\x00garbage",
        json.dumps({"token_ids": [1], "sampling_params": {}, "ec_transfer_params": 1e999}),
    ],
)
def test_validate_subprocess_one_line(tmp_path: Path, data: str | bytes) -> None:
    path = tmp_path / "in.json"
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    p = subprocess.run(
        [sys.executable, "-m", "epd.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode in (1, 2)
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
