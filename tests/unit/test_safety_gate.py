"""Issue 7, the validator / vLLM-wire side: one test (or more) per defect.

1. ``epd vllm split`` per item: caller params covering some items, duplicates, old renders.
2. strict: a ``kwargs_data`` slot without the encoder inputs is not full data.
3. strict: empty or falsy EC entries are refused.
4. strict: a grid in ``kwargs_data`` and one in ``mm_metadata`` must agree.
5. ``vllm`` mode is exactly vLLM 0.33's ``/inference/v1/generate`` (over- and under-accepting).
6. no crash: a uint64 scalar item, deep JSON.
"""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from schemas.errors import ValidationError
from schemas.types import Features, ItemData, PlaceholderRange, RenderEvent, TensorRef
from schemas.validator import ValidationConfig, validate_features, validate_render_event
from schemas.vllm_rules import check_vllm_request
from schemas.vllm_split import split_render
from schemas.vllm_wire import decode_item, encode_item, validate_request_json
from tests.unit.test_vllm_wire import make_render

ROOT = Path(__file__).resolve().parents[2]
STRICT = ValidationConfig()
VLLM = ValidationConfig(mode="vllm")


def rejected(fn: Any, *args: Any) -> ValidationError:
    with pytest.raises(ValidationError) as ei:
        fn(*args)
    return ei.value


def grid(t: int, h: int, w: int) -> torch.Tensor:
    return torch.tensor([t, h, w])


def image_audio_render() -> dict[str, Any]:
    """An image (grid 1x4x4 -> 4 tokens) and an audio item, both with full data and metadata."""
    img = {"pixel_values": torch.randn(16, 12), "image_grid_thw": grid(1, 4, 4)}
    aud = {"input_features": torch.randn(6, 8), "audio_feature_lengths": torch.tensor([6])}
    return {
        "request_id": "r",
        "token_ids": list(range(20)),
        "features": {
            "mm_hashes": {"image": ["img"], "audio": ["aud"]},
            "mm_placeholders": {
                "image": [{"offset": 1, "length": 4}],
                "audio": [{"offset": 8, "length": 6}],
            },
            "kwargs_data": {"image": [encode_item(img)], "audio": [encode_item(aud)]},
            "mm_metadata": {
                "image": [encode_item({"image_grid_thw": img["image_grid_thw"]})],
                "audio": [encode_item({"audio_feature_lengths": aud["audio_feature_lengths"]})],
            },
        },
        "sampling_params": {"max_tokens": 4},
    }


# --------------------------------------------------------------------------- 1. split


def test_split_item_without_its_own_entry_keeps_its_data() -> None:
    render = image_audio_render()
    params = {"aud": {"transfer_id": "t-aud"}}
    out = split_render(render, params, secret=None)
    f = out["prefill"]["features"]
    assert f["kwargs_data"]["image"] == render["features"]["kwargs_data"]["image"]
    assert f["kwargs_data"]["audio"] == [None]
    assert f["mm_metadata"]["audio"] == render["features"]["mm_metadata"]["audio"]
    # Only the audio is encoded, and its request carries only its own entry.
    assert [e["features"]["mm_hashes"] for e in out["encode"]] == [{"audio": ["aud"]}]
    assert out["encode"][0]["ec_transfer_params"] == params
    # ...also in the ec_items shape, where another item's entry must not leak in either.
    items = {"ec_items": [{"mm_hash": "aud", "transfer_id": "t"}], "engine": "e"}
    out = split_render(render, items, secret=None)
    assert out["encode"][0]["ec_transfer_params"] == items
    assert out["prefill"]["features"]["kwargs_data"]["image"] is not None


def test_split_empty_entry_is_no_entry() -> None:
    out = split_render(image_audio_render(), {"img": {}, "aud": {"x": 1}}, secret=None)
    assert out["prefill"]["features"]["kwargs_data"]["image"] is not None
    assert [e["request_id"] for e in out["encode"]] == ["r-encode-audio-0"]


def test_split_refuses_item_that_cannot_get_its_embedding() -> None:
    render = image_audio_render()
    render["features"]["kwargs_data"]["image"] = [None]  # metadata-only image (cache hit)
    e = rejected(lambda: split_render(render, {"aud": {"transfer_id": "t"}}, secret=None))
    assert (e.rule, e.modality, e.item) == ("ec-transfer-required", "image", 0)
    assert "img" in str(e)


def test_split_refuses_grid_only_kwargs_without_entry() -> None:
    render = image_audio_render()
    render["features"]["kwargs_data"]["image"] = [encode_item({"image_grid_thw": grid(1, 4, 4)})]
    e = rejected(lambda: split_render(render, {"aud": {"transfer_id": "t"}}, secret=None))
    assert (e.rule, e.modality, e.item) == ("ec-transfer-required", "image", 0)


def test_split_same_hash_twice_gives_one_encode_request() -> None:
    render = make_render(video=False)
    render["features"]["mm_hashes"]["image"] = ["same", "same"]
    out = split_render(render, secret=None, now=0)
    assert [e["features"]["mm_hashes"] for e in out["encode"]] == [{"image": ["same"]}]
    f = out["prefill"]["features"]
    assert f["kwargs_data"] is None and len(f["mm_metadata"]["image"]) == 2


def test_split_recovers_metadata_with_caller_params() -> None:
    render = image_audio_render()
    render["features"]["mm_metadata"] = None  # a render from before mm_metadata existed
    out = split_render(render, {"img": {"k": "1"}, "aud": {"k": "2"}}, secret=None)
    f = out["prefill"]["features"]
    assert f["kwargs_data"] is None
    (img_meta,) = f["mm_metadata"]["image"]
    assert decode_item(img_meta)[0]["image_grid_thw"].tolist() == [1, 4, 4]
    (aud_meta,) = f["mm_metadata"]["audio"]
    assert list(decode_item(aud_meta)[0]) == ["audio_feature_lengths"]
    check_vllm_request(out["prefill"])


def _split_cli(tmp_path: Path, render: dict[str, Any], *flags: str) -> subprocess.CompletedProcess:
    path = tmp_path / "render.json"
    path.write_text(json.dumps(render))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("EPD_EC_SECRET", None)
    return subprocess.run(
        [sys.executable, "-m", "epd.cli", "vllm", "split", str(path), *flags],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_split_cli_end_to_end(tmp_path: Path) -> None:
    """Defect 1 through the real command: partial params keep the image's data; a metadata-only
    image without an entry is refused with the rule, modality and item on one line."""
    render = image_audio_render()
    params = json.dumps({"aud": {"transfer_id": "t-aud"}})
    p = _split_cli(tmp_path, render, "--ec-transfer-params", params)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["prefill"]["features"]["kwargs_data"]["image"] is not None
    assert [e["ec_transfer_params"] for e in out["encode"]] == [json.loads(params)]
    render["features"]["kwargs_data"]["image"] = [None]
    p = _split_cli(tmp_path, render, "--ec-transfer-params", params)
    assert p.returncode == 1
    assert p.stderr.startswith("rejected: rule=ec-transfer-required modality=image item=0")
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


# --------------------------------------------------------------------------- 2-4. strict


def feats(full: ItemData | None, meta: ItemData | None, modality: str = "image") -> Features:
    return Features(
        mm_hashes={modality: ["h"]},
        mm_placeholders={modality: [PlaceholderRange(2, 4)]},
        kwargs_data={modality: [full]},
        mm_metadata={modality: [meta]},
    )


ENTRY = {"h": {"key": "ec:fp:h", "store": "redis://x"}}
TOKENS = list(range(20))


def test_strict_grid_only_kwargs_is_not_full_data() -> None:
    f = feats({"image_grid_thw": grid(1, 4, 4)}, None)
    e = rejected(validate_features, TOKENS, f, None, STRICT)
    assert (e.rule, e.modality, e.item) == ("ec-transfer-required", "image", 0)
    assert "pixel_values" not in str(e) or "without encoder inputs" in str(e)
    validate_features(TOKENS, f, ENTRY, STRICT)  # with an entry the embedding can come
    full = feats({"pixel_values": torch.randn(16, 4), "image_grid_thw": grid(1, 4, 4)}, None)
    validate_features(TOKENS, full, None, STRICT)
    # unknown modality: any non-metadata field is its encoder input
    a = feats({"audio_feature_lengths": torch.tensor([4])}, None, "audio")
    assert rejected(validate_features, TOKENS, a, None, STRICT).rule == "ec-transfer-required"
    a = feats({"input_features": torch.randn(4, 2)}, None, "audio")
    validate_features(TOKENS, a, None, STRICT)


def test_render_event_needs_encoder_inputs() -> None:
    f = feats({"image_grid_thw": grid(1, 4, 4)}, None)
    ev = RenderEvent(request_id="r", model="tiny", token_ids=TOKENS, features=f)
    e = rejected(validate_render_event, ev)
    assert (e.rule, e.modality, e.item) == ("render-data-missing", "image", 0)


@pytest.mark.parametrize(
    "params",
    [
        {"h": {}},
        {"h": False},
        {"h": 0},
        {"h": ""},
        {"h": []},
        {"h": "opaque"},
        {"h": {"mm_hash": "h"}},
        {"h": {"key": "", "transfer_id": None}},
        {"ec_items": [{"mm_hash": "h"}]},
    ],
)
def test_strict_refuses_empty_entries(params: dict[str, Any]) -> None:
    f = feats(None, {"image_grid_thw": grid(1, 4, 4)})
    e = rejected(validate_features, TOKENS, f, params, STRICT)
    assert (e.rule, e.modality, e.item) == ("ec-entry", "image", 0)
    # vLLM only asks for a non-empty ec_transfer_params, whatever the entries hold
    validate_features(TOKENS, f, params, VLLM)


def test_strict_null_entry_is_no_entry() -> None:
    f = feats(None, {"image_grid_thw": grid(1, 4, 4)})
    e = rejected(validate_features, TOKENS, f, {"h": None}, STRICT)
    assert e.rule == "ec-transfer-required"


def test_strict_grids_must_agree() -> None:
    pv = torch.randn(64, 4)
    f = feats(
        {"pixel_values": pv, "image_grid_thw": grid(1, 4, 16)}, {"image_grid_thw": grid(1, 8, 8)}
    )
    e = rejected(validate_features, list(range(40)), _len(f, 16), None, STRICT)
    assert (e.rule, e.modality, e.item, e.field) == (
        "grid-consistency",
        "image",
        0,
        "image_grid_thw",
    )
    assert "[1, 4, 16]" in str(e) and "[1, 8, 8]" in str(e)
    same = feats(
        {"pixel_values": pv, "image_grid_thw": grid(1, 8, 8)}, {"image_grid_thw": grid(1, 8, 8)}
    )
    validate_features(list(range(40)), _len(same, 16), None, STRICT)
    # another metadata field in both slots must agree too
    s = {"image_grid_thw": grid(1, 8, 8)}
    f = feats(
        {"pixel_values": pv, **s, "second_per_grid_ts": torch.tensor([1.0])},
        {**s, "second_per_grid_ts": torch.tensor([2.0])},
    )
    assert rejected(validate_features, list(range(40)), _len(f, 16), None, STRICT).rule == (
        "metadata-consistency"
    )


def test_strict_grid_in_both_slots_must_be_inline() -> None:
    ref = TensorRef("redis://x", "ec:blob", "int64", [3], 24, digest="d")
    f = feats(
        {"pixel_values": torch.randn(16, 4), "image_grid_thw": ref},
        {"image_grid_thw": grid(1, 4, 4)},
    )
    e = rejected(validate_features, TOKENS, f, None, STRICT)
    assert (e.rule, e.field) == ("grid-consistency", "image_grid_thw")


def _len(f: Features, n: int) -> Features:
    f.mm_placeholders["image"][0] = PlaceholderRange(2, n)
    return f


# --------------------------------------------------------------------------- 5. vllm mode


def request(**over: Any) -> dict[str, Any]:
    """A metadata-only request with its EC params at the top level: vLLM accepts it."""
    body = make_render(video_meta=True)
    body["features"]["kwargs_data"] = None
    body["ec_transfer_params"] = {"img-a": {"x": 1}}
    body.update(over)
    return body


def b64(doc: Any) -> str:
    return base64.b64encode(msgpack.packb(doc, use_bin_type=True)).decode()


RAW2 = msgpack.ExtType(3, struct.pack("<2q", 1, 2))


def with_meta_item(doc: Any) -> dict[str, Any]:
    body = request()
    body["features"]["mm_metadata"]["image"][0] = b64(doc)
    return body


def _no_sampling() -> dict[str, Any]:
    body = request()
    del body["sampling_params"]
    return body


def _ec_in_extra_args() -> dict[str, Any]:
    body = request()
    body["sampling_params"]["extra_args"] = {"ec_transfer_params": body.pop("ec_transfer_params")}
    return body


def _is_embed_other_length() -> dict[str, Any]:
    body = request()
    body["features"]["mm_placeholders"]["image"][0]["is_embed"] = [True]
    return body


def _coerced_ids() -> dict[str, Any]:
    body = request()
    body["token_ids"][:3] = [1.0, True, "0"]
    body["features"]["mm_placeholders"]["image"][0] = {"offset": "1", "length": 4.0}
    return body


ACCEPTED = {
    "is_embed of another length": _is_embed_other_length,
    "ids and offsets vLLM coerces": _coerced_ids,
    "null data (engine-cached element)": lambda: with_meta_item(
        {"g": {"data": None, "field": ["batched", {}]}}
    ),
    "tensor bytes as msgpack bin": lambda: with_meta_item(
        {"g": {"data": ["int64", [2], RAW2.data], "field": ["batched", {"keep_on_cpu": True}]}}
    ),
    "uint64 scalar": lambda: with_meta_item({"g": {"data": 2**64 - 1, "field": ["batched", {}]}}),
    "-1 in the shape": lambda: with_meta_item(
        {"g": {"data": ["int64", [-1], RAW2], "field": ["batched", {}]}}
    ),
    "empty ec for full items only": lambda: {
        **make_render(omit_empty_modality=False),
        "ec_transfer_params": {},
    },
}

REJECTED = {
    "no sampling_params": (_no_sampling, "request-shape"),
    "EC params only under extra_args": (_ec_in_extra_args, "ec-transfer-required"),
    "empty top-level EC params": (lambda: request(ec_transfer_params={}), "ec-transfer-required"),
    "positional field spec (older vLLM)": (
        lambda: with_meta_item({"g": {"data": ["int64", [2], RAW2], "field": ["batched", True]}}),
        "tensor",
    ),
    "unknown factory": (
        lambda: with_meta_item({"g": {"data": ["int64", [2], RAW2], "field": ["x", {}]}}),
        "tensor",
    ),
    "extra element key": (
        lambda: with_meta_item({"g": {"data": None, "field": ["batched", {}], "z": 1}}),
        "tensor",
    ),
    "size mismatch": (
        lambda: with_meta_item({"g": {"data": ["int64", [3], RAW2], "field": ["batched", {}]}}),
        "tensor",
    ),
    "ext type 1": (
        lambda: with_meta_item(
            {"g": {"data": 1, "field": ["batched", {"k": msgpack.ExtType(1, b"")}]}}
        ),
        "tensor",
    ),
    "cache_salt with a slash": (lambda: request(cache_salt="a/b"), "request-shape"),
    "int msgpack cannot hold in ec params": (
        lambda: request(ec_transfer_params={"img-a": {"x": 2**64}}),
        "request-shape",
    ),
    "lone surrogate in ec params": (
        lambda: request(ec_transfer_params={"img-a": {"x": "\ud800"}}),
        "request-shape",
    ),
    "content_parts and features": (lambda: request(content_parts=[{"type": "x"}]), "request-shape"),
    "text output without detokenize": (
        lambda: request(output_mode="text", sampling_params={"detokenize": False}),
        "request-shape",
    ),
    "negative token id as a string": (lambda: request(token_ids=["-1"]), "token-ids"),
    "fractional offset": (
        lambda: _set_place(request(), {"offset": 1.5, "length": 4}),
        "placeholder-range",
    ),
}


def _set_place(body: dict[str, Any], place: dict[str, Any]) -> dict[str, Any]:
    body["features"]["mm_placeholders"]["image"][0] = place
    return body


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_vllm_mode_accepts_what_vllm_accepts(name: str) -> None:
    body = ACCEPTED[name]()
    check_vllm_request(body)
    validate_request_json(body, VLLM)


@pytest.mark.parametrize("name", sorted(REJECTED))
def test_vllm_mode_rejects_what_vllm_rejects(name: str) -> None:
    make, rule = REJECTED[name]
    e = rejected(validate_request_json, make(), VLLM)
    assert e.rule == rule, str(e)
    # strict never accepts what vLLM refuses
    assert rejected(validate_request_json, make(), STRICT).rule == rule


def test_vllm_mode_names_the_item_that_fails_to_decode() -> None:
    body = request()
    body["features"]["mm_metadata"]["video"][0] = "%%%"
    e = rejected(check_vllm_request, body)
    assert (e.rule, e.modality, e.item) == ("tensor", "video", 0)


def test_our_encoder_output_decodes_under_vllm_rules() -> None:
    """vLLM 0.33 decodes ``[factory, {kwargs}]`` only; what we write must pass its decoder."""
    check_vllm_request(make_render(omit_empty_modality=False))
    check_vllm_request(split_render(make_render(), secret=None, now=0)["prefill"])


# --------------------------------------------------------------------------- 6. no crashes


def test_uint64_scalar_is_a_verdict_in_strict() -> None:
    item = b64({"g": {"data": 2**64 - 1, "field": ["batched", {}]}})
    e = rejected(lambda: decode_item(item, modality="image", item=0))
    assert (e.rule, e.modality, e.item, e.field) == ("tensor", "image", 0, "g")
    assert "int64" in str(e)


def test_validate_deep_json_exits_2_in_a_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-m", "epd.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "nested too deeply" in p.stderr


def test_moderately_deep_json_is_a_verdict() -> None:
    body = request()
    body["kv_transfer_params"] = {"x": _nest(900)}
    for cfg in (STRICT, VLLM):
        try:
            validate_request_json(body, cfg)
        except ValidationError as e:
            assert e.rule == "request-shape"


def _nest(n: int) -> Any:
    v: Any = 0
    for _ in range(n):
        v = [v]
    return v
