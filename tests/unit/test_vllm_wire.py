"""vLLM scale-out JSON interop: item encoding, golden bytes, GenerateRequest round trip, split."""

from __future__ import annotations

import base64
import copy
import json
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from schemas.errors import ValidationError
from schemas.signing import verify_ec
from schemas.tensors import DTYPES
from schemas.types import ECTransfer
from schemas.validator import ValidationConfig, validate_features
from schemas.vllm_split import split_render
from schemas.vllm_wire import (
    FieldSpec,
    batched,
    decode_item,
    encode_item,
    features_from_json,
    features_to_json,
    flat,
    generate_request_to_json,
    parse_generate_request,
)

GOLDEN = Path(__file__).parent / "golden" / "qwen2vl_image_item.b64"
SECRET = b"wire-secret"


def golden_item() -> dict[str, torch.Tensor]:
    """The small Qwen2-VL image item behind the golden file (grid 1x2x2 -> 4 patch rows)."""
    pv = (torch.arange(12, dtype=torch.float32).reshape(4, 3) - 4).to(torch.bfloat16)
    return {"pixel_values": pv, "image_grid_thw": torch.tensor([1, 2, 2], dtype=torch.int64)}


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(
        dtype
    )


# --------------------------------------------------------------------------- items


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(5, 3), (7,), (), (0, 4)])
def test_item_round_trip_every_dtype(name: str, shape: tuple[int, ...]) -> None:
    t = sample(DTYPES[name], shape)
    decoded, specs = decode_item(encode_item({"x": t, "image_grid_thw": torch.tensor([1, 2, 2])}))
    assert decoded["x"].dtype == t.dtype
    assert list(decoded["x"].shape) == list(shape)
    assert torch.equal(decoded["x"], t)
    assert torch.equal(decoded["image_grid_thw"], torch.tensor([1, 2, 2]))
    assert specs["x"] == batched()


def test_bfloat16_bits_preserved() -> None:
    # Exact bit patterns survive: neighbours, max finite, a NaN payload, -inf, a subnormal.
    raw = torch.tensor([0x3F80, 0x3F81, 0x7F7F, 0x7FC1, -0x80, 0x0001], dtype=torch.int16)
    t = raw.view(torch.bfloat16)
    decoded, _ = decode_item(encode_item({"pixel_values": t}))
    assert torch.equal(decoded["pixel_values"].view(torch.int16), raw)


def test_non_contiguous_tensor_encoded_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()
    decoded, _ = decode_item(encode_item({"a": t}))
    assert torch.equal(decoded["a"], t)


def test_golden_bytes() -> None:
    golden = GOLDEN.read_text().strip()
    assert encode_item(golden_item()) == golden
    decoded, specs = decode_item(golden)
    for k, v in golden_item().items():
        assert decoded[k].dtype == v.dtype and torch.equal(decoded[k], v)
    assert specs["image_grid_thw"] == FieldSpec("batched", {"keep_on_cpu": True})
    assert specs["pixel_values"].factory == "flat"


def test_golden_layout_read_with_plain_msgpack() -> None:
    """The golden item has vLLM's layout, checked without our decoder."""
    doc = msgpack.unpackb(base64.b64decode(GOLDEN.read_text().strip()), raw=False)
    assert list(doc) == ["pixel_values", "image_grid_thw"]
    pv = doc["pixel_values"]
    assert set(pv) == {"data", "field"}
    dtype, shape, ext = pv["data"]
    assert (dtype, shape) == ("bfloat16", [4, 3])
    assert isinstance(ext, msgpack.ExtType) and ext.code == 3
    # bf16 is the upper half of the float32 bit pattern (values here are exact), little-endian.
    want = b"".join(
        struct.pack("<H", struct.unpack("<I", struct.pack("<f", float(v)))[0] >> 16)
        for v in range(-4, 8)
    )
    assert ext.data == want
    # vLLM 0.33's layout: [factory, {every field of the field dataclass}]
    assert pv["field"] == ["flat", {"keep_on_cpu": False, "slices": [[0, 4, None]], "dim": 0}]
    grid = doc["image_grid_thw"]
    assert grid["data"][0:2] == ["int64", [3]]
    assert grid["data"][2].data == struct.pack("<3q", 1, 2, 2)
    assert grid["field"] == ["batched", {"keep_on_cpu": True}]


def test_field_specs() -> None:
    t = torch.zeros(6, 2)
    doc = msgpack.unpackb(
        base64.b64decode(
            encode_item(
                {"a": t, "b": t, "c": t},
                {
                    "a": flat(6, dim=1, keep_on_cpu=True),
                    "b": FieldSpec("shared", {"batch_size": 3}),
                },
            )
        )
    )
    assert doc["a"]["field"] == [
        "flat",
        {"keep_on_cpu": True, "slices": [[[None, None, None], [0, 6, None]]], "dim": 1},
    ]
    assert doc["b"]["field"] == ["shared", {"keep_on_cpu": False, "batch_size": 3}]
    assert doc["c"]["field"] == ["batched", {"keep_on_cpu": False}]


def _item_b64(doc: Any) -> str:
    return base64.b64encode(msgpack.packb(doc, use_bin_type=True)).decode()


def test_decoder_accepts_other_vllm_field_layouts() -> None:
    data = ["int64", [2], msgpack.ExtType(3, struct.pack("<2q", 4, 5))]
    kw = {"keep_on_cpu": True, "slices": [[0, 2, None]], "dim": 0}
    _, specs = decode_item(_item_b64({"a": {"data": data, "field": ["flat", kw]}}))
    assert specs["a"] == FieldSpec("flat", kw)
    _, specs = decode_item(_item_b64({"a": {"data": data, "field": ["flat", [[0, 2, None]], 0]}}))
    assert specs["a"].values == {"slices": [[0, 2, None]], "dim": 0}
    assert not specs["a"].keep_on_cpu
    tensors, _ = decode_item(_item_b64({"a": {"data": 7, "field": ["batched", False]}}))
    assert tensors["a"].item() == 7


GOOD = ["int64", [2], msgpack.ExtType(3, struct.pack("<2q", 4, 5))]


@pytest.mark.parametrize(
    ("b64", "needle"),
    [
        ("not base64!!", "base64"),
        (base64.b64encode(b"\xc1").decode(), "msgpack"),
        (_item_b64([1, 2]), "map"),
        (
            _item_b64(
                {
                    "f": {
                        "data": ["int64", [2], msgpack.ExtType(5, b"x" * 16)],
                        "field": ["batched", False],
                    }
                }
            ),
            "ext type 5",
        ),
        (
            _item_b64({"f": {"data": ["int64", [3], GOOD[2]], "field": ["batched", False]}}),
            "size mismatch",
        ),
        (
            _item_b64({"f": {"data": ["complex64", [2], GOOD[2]], "field": ["batched", False]}}),
            "dtype",
        ),
        (
            _item_b64({"f": {"data": ["int64", [-2], GOOD[2]], "field": ["batched", False]}}),
            "shape",
        ),
        (_item_b64({"f": {"data": ["int64", [2], 1], "field": ["batched", False]}}), "out-of-band"),
        (_item_b64({"f": {"data": ["int64", [2], b"x" * 16], "field": ["batched", False]}}), "ext"),
        (_item_b64({"f": {"data": GOOD, "field": ["weird", False]}}), "factory"),
        (_item_b64({"f": {"data": None, "field": ["batched", False]}}), "null"),
        (_item_b64({"f": {"data": GOOD}}), '"field"'),
        (_item_b64({"f": {"data": [GOOD, GOOD], "field": ["batched", False]}}), "nested"),
    ],
)
def test_decode_errors_are_typed(b64: str, needle: str) -> None:
    with pytest.raises(ValidationError) as ei:
        decode_item(b64, modality="image", item=3)
    e = ei.value
    assert (e.rule, e.modality, e.item) == ("tensor", "image", 3)
    assert needle in str(e)


def test_decode_error_names_field() -> None:
    b64 = _item_b64(
        {"pixel_values": {"data": ["int64", [3], GOOD[2]], "field": ["batched", False]}}
    )
    with pytest.raises(ValidationError) as ei:
        decode_item(b64)
    assert ei.value.field == "pixel_values"


# --------------------------------------------------------------------------- requests


def make_render(
    *,
    image_meta: bool = True,
    video: bool = True,
    video_meta: bool = False,
    omit_empty_modality: bool = True,
) -> dict[str, Any]:
    """A vLLM-style render response: 2 images (grid 1x4x4 -> 4 tokens) and 1 video (8 tokens).

    With ``omit_empty_modality`` the modality without metadata is left out of ``mm_metadata``,
    as vLLM 0.33 does.
    """
    img = [
        {"pixel_values": torch.randn(16, 12), "image_grid_thw": torch.tensor([1, 4, 4])}
        for _ in range(2)
    ]
    vid = {"pixel_values_videos": torch.randn(32, 12), "video_grid_thw": torch.tensor([2, 4, 4])}
    hashes: dict[str, list[str]] = {"image": ["img-a", "img-b"]}
    places: dict[str, list[dict[str, Any]]] = {
        "image": [{"offset": 1, "length": 4}, {"offset": 6, "length": 4}]
    }
    kwargs: dict[str, list[Any]] = {"image": [encode_item(x) for x in img]}
    meta: dict[str, list[Any]] = {}
    if image_meta:
        meta["image"] = [encode_item({"image_grid_thw": x["image_grid_thw"]}) for x in img]
    if video:
        hashes["video"] = ["vid-a"]
        places["video"] = [{"offset": 12, "length": 8}]
        kwargs["video"] = [encode_item(vid)]
        if video_meta:
            meta["video"] = [encode_item({"video_grid_thw": vid["video_grid_thw"]})]
        elif not omit_empty_modality and meta:
            meta["video"] = [None]
    return {
        "request_id": "req-1",
        "token_ids": list(range(100, 124)),
        "features": {
            "mm_hashes": hashes,
            "mm_placeholders": places,
            "kwargs_data": kwargs,
            "mm_metadata": meta or None,
        },
        "sampling_params": {"max_tokens": 8, "temperature": 0.0},
        "model": "qwen2-vl",
        "stream": False,
        "cache_salt": "salt",
        "priority": 0,
        "kv_transfer_params": {"do_remote_decode": True},
    }


def test_generate_request_round_trip_preserves_unknown_fields() -> None:
    obj = make_render(omit_empty_modality=False)
    obj["future_field"] = {"x": [1, 2]}
    obj["features"]["requires_kv"] = False
    req = parse_generate_request(obj)
    assert req.request_id == "req-1" and req.model == "qwen2-vl" and req.cache_salt == "salt"
    assert req.extra["future_field"] == {"x": [1, 2]}
    assert req.features is not None and req.features.kwargs_data is not None
    assert req.features.kwargs_data["image"][0] is not None
    assert req.features.kwargs_data["image"][0]["pixel_values"].shape == (16, 12)
    # Our own items re-encode to the same strings, so the whole body round-trips exactly.
    assert generate_request_to_json(req) == obj
    assert json.loads(json.dumps(generate_request_to_json(req))) == obj


def test_features_json_round_trip_with_is_embed() -> None:
    obj = make_render()["features"]
    obj["mm_placeholders"]["image"][0]["is_embed"] = [True, True, True, True]
    f = features_from_json(obj)
    assert f.mm_placeholders["image"][0].is_embed == [True] * 4
    assert features_to_json(f) == obj


def test_ec_transfer_params_from_extra_args() -> None:
    obj = make_render()
    obj["sampling_params"]["extra_args"] = {"ec_transfer_params": {"img-a": {"k": 1}}}
    assert parse_generate_request(obj).ec_transfer_params == {"img-a": {"k": 1}}
    obj["ec_transfer_params"] = {"img-b": {}}
    assert parse_generate_request(obj).ec_transfer_params == {"img-b": {}}


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda o: o.pop("token_ids"), "token_ids"),
        (lambda o: o.__setitem__("sampling_params", []), "sampling_params"),
        (lambda o: o["features"].__setitem__("mm_hashes", {"image": [1]}), "mm_hashes"),
        (
            lambda o: o["features"]["mm_placeholders"]["image"].__setitem__(0, {"offset": 1}),
            "mm_placeholders",
        ),
        (lambda o: o["features"].__setitem__("kwargs_data", []), "kwargs_data"),
        (lambda o: o.__setitem__("ec_transfer_params", [1]), "ec_transfer_params"),
    ],
)
def test_request_shape_errors(mutate: Any, field: str) -> None:
    obj = make_render()
    mutate(obj)
    with pytest.raises(ValidationError) as ei:
        parse_generate_request(obj)
    assert (ei.value.rule, ei.value.field) == ("request-shape", field)


def test_bad_item_in_request_names_modality_and_index() -> None:
    obj = make_render()
    obj["features"]["kwargs_data"]["image"][1] = "@@@"
    with pytest.raises(ValidationError) as ei:
        parse_generate_request(obj)
    assert (ei.value.rule, ei.value.modality, ei.value.item) == ("tensor", "image", 1)


# --------------------------------------------------------------------------- split


def _validate_json(obj: dict[str, Any], cfg: ValidationConfig) -> None:
    req = parse_generate_request(obj)
    validate_features(req.token_ids, req.features, req.ec_transfer_params, cfg)


STRICT_SIGNED = ValidationConfig(secret=SECRET, now_ms=lambda: 1_000)


def test_split_image_metadata_video_full() -> None:
    render = make_render()  # vLLM 0.33 shape: no "video" key in mm_metadata
    original = copy.deepcopy(render)
    out = split_render(render, secret=SECRET, store="redis://s", model_fingerprint="fp", now=0)
    assert render == original  # input untouched

    enc = out["encode"]
    assert [e["features"]["mm_hashes"] for e in enc] == [
        {"image": ["img-a"]},
        {"image": ["img-b"]},
        {"video": ["vid-a"]},
    ]
    for e, (m, i) in zip(enc, [("image", 0), ("image", 1), ("video", 0)], strict=True):
        assert e["sampling_params"]["max_tokens"] == 1
        assert e["sampling_params"]["temperature"] == 0.0
        assert e["features"]["kwargs_data"][m] == [render["features"]["kwargs_data"][m][i]]
        assert e["features"]["mm_placeholders"][m] == [render["features"]["mm_placeholders"][m][i]]
        assert "kv_transfer_params" not in e
        assert e["model"] == "qwen2-vl" and e["cache_salt"] == "salt"
        assert list(e["ec_transfer_params"]) == e["features"]["mm_hashes"][m]
        _validate_json(e, STRICT_SIGNED)
        _validate_json(e, ValidationConfig(mode="vllm"))
    assert len({e["request_id"] for e in enc}) == 3

    pre = out["prefill"]
    f = pre["features"]
    # Every item has an entry: all travel metadata-only. The video had no mm_metadata (a
    # render from before it existed): its grid is recovered from its kwargs_data.
    assert f["kwargs_data"] is None
    assert f["mm_metadata"]["image"] == render["features"]["mm_metadata"]["image"]
    (video_meta,) = f["mm_metadata"]["video"]
    tensors, specs = decode_item(video_meta)
    assert list(tensors) == ["video_grid_thw"] and tensors["video_grid_thw"].tolist() == [2, 4, 4]
    assert specs["video_grid_thw"].keep_on_cpu
    assert pre["request_id"] == "req-1" and pre["kv_transfer_params"] == {"do_remote_decode": True}
    assert pre["sampling_params"]["max_tokens"] == 8
    ec = pre["ec_transfer_params"]
    assert set(ec) == {"img-a", "img-b", "vid-a"}
    for h, e in ec.items():
        assert e["key"] == f"ec:fp:{h}" and e["store"] == "redis://s"
        assert e["expires_ms"] == 600_000
        assert verify_ec(SECRET, ECTransfer(**e))
    _validate_json(pre, STRICT_SIGNED)
    _validate_json(pre, ValidationConfig(mode="vllm"))
    # The images' heavy inputs appear nowhere in the prefill body.
    body = json.dumps(pre)
    for items in render["features"]["kwargs_data"].values():
        assert all(b64 not in body for b64 in items)


def test_split_prefill_is_unsafe_without_its_ec_params() -> None:
    pre = split_render(make_render(), secret=SECRET, now=0)["prefill"]
    del pre["ec_transfer_params"]
    for cfg in (STRICT_SIGNED, ValidationConfig(mode="vllm")):
        with pytest.raises(ValidationError) as ei:
            _validate_json(pre, cfg)
        assert (ei.value.rule, ei.value.modality, ei.value.item) == (
            "ec-transfer-required",
            "image",
            0,
        )


def test_split_with_given_ec_items() -> None:
    params = {
        "ec_items": [
            {"mm_hash": "img-a", "transfer_id": "t1"},
            {"mm_hash": "img-b", "transfer_id": "t2"},
            {"mm_hash": "vid-a", "transfer_id": "t3"},
        ],
        "engine": "e0",
    }
    out = split_render(make_render(video_meta=True), params, secret=None)
    assert out["prefill"]["ec_transfer_params"] == params
    assert out["prefill"]["features"]["kwargs_data"] is None  # every item metadata-only
    assert out["encode"][1]["ec_transfer_params"] == {
        "engine": "e0",
        "ec_items": [{"mm_hash": "img-b", "transfer_id": "t2"}],
    }
    _validate_json(out["prefill"], ValidationConfig())
    _validate_json(out["prefill"], ValidationConfig(mode="vllm"))


def test_split_recovers_metadata_of_renders_without_mm_metadata() -> None:
    render = make_render(image_meta=False)
    out = split_render(render, secret=None, now=0)
    f = out["prefill"]["features"]
    assert f["kwargs_data"] is None
    grids = [decode_item(b64)[0] for m in ("image", "video") for b64 in f["mm_metadata"][m]]
    assert [list(g) for g in grids] == [["image_grid_thw"]] * 2 + [["video_grid_thw"]]
    assert len(out["encode"]) == 3
    _validate_json(out["prefill"], ValidationConfig())
    _validate_json(out["prefill"], ValidationConfig(mode="vllm"))


def test_split_unsigned_entries_without_secret() -> None:
    out = split_render(make_render(), secret=None, now=0)
    assert all(e["signature"] == "" for e in out["prefill"]["ec_transfer_params"].values())
    _validate_json(out["prefill"], ValidationConfig())
    with pytest.raises(ValidationError) as ei:
        _validate_json(out["prefill"], ValidationConfig(secret=SECRET))
    assert ei.value.rule == "ec-signature"


def test_split_rejects_a_broken_render() -> None:
    render = make_render()
    render["features"]["mm_placeholders"]["video"][0]["offset"] = 8  # overlaps image 1
    with pytest.raises(ValidationError) as ei:
        split_render(render, secret=None)
    assert ei.value.rule == "placeholder-overlap"
    render = make_render()
    render["features"] = None
    with pytest.raises(ValidationError) as ei:
        split_render(render, secret=None)
    assert ei.value.rule == "request-shape"


# ------------------------------------------------------------------ sampling_params


def test_vllm_sampling_params_map_both_ways_with_vllms_defaults() -> None:
    from schemas.types import SamplingParams
    from schemas.vllm_sampling import sampling_from_vllm, sampling_to_vllm

    assert sampling_from_vllm({}) == SamplingParams(max_tokens=16, temperature=1.0)
    got = sampling_from_vllm(
        {
            "max_tokens": 40,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 5,
            "stop": "END",
            "stop_token_ids": [3],
            "ignore_eos": True,
            "n": 1,
            "repetition_penalty": 1.0,
            "detokenize": True,
            "extra_args": {"ec_transfer_params": {}},
        }
    )
    assert got == SamplingParams(40, 0.7, [3], True, 0.9, 0, 5, ["END"])
    assert sampling_from_vllm(sampling_to_vllm(got)) == got
    greedy = SamplingParams(max_tokens=8)
    assert sampling_from_vllm(sampling_to_vllm(greedy)) == greedy  # temperature 0 spelled out


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"n": 2}, "n"),
        ({"n": True}, "n"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"min_p": 0.1}, "min_p"),
        ({"logprobs": 5}, "logprobs"),
        # a count on vLLM's wire: 0 (and false, which equals 0) asks for the sampled token's
        ({"logprobs": 0}, "logprobs"),
        ({"logprobs": False}, "logprobs"),
        ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 2.5}, "top_k"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": "x"}, "stop_token_ids"),
        ({"seed": True}, "seed"),
    ],
)
def test_vllm_sampling_params_we_cannot_honour_are_refused_not_ignored(
    params: dict, field: str
) -> None:
    from schemas.vllm_sampling import sampling_from_vllm

    with pytest.raises(ValidationError) as err:
        sampling_from_vllm(params)
    assert (err.value.rule, err.value.field) == ("sampling", field)


def test_kv_transfer_params_pass_through_the_wire_the_split_and_the_events_unchanged() -> None:
    """vLLM's NIXL P/D parameters: parsed as a field, written back as read, and carried as JSON
    text through the prefill and decode events."""
    from schemas.codec import get_codec
    from schemas.types import DecodeEvent, Features, PrefillEvent
    from schemas.vllm_wire import (
        generate_request_to_json,
        kv_transfer_params_from_text,
        kv_transfer_params_text,
        parse_generate_request,
    )

    kv = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "engine-7",
        "remote_block_ids": [[1, 2, 3]],
        "remote_host": "10.0.0.7",
        "remote_port": 5600,
        "tp_size": 1,
    }
    body = {
        "request_id": "r-kv",
        "token_ids": [1, 2, 3],
        "sampling_params": {},
        "kv_transfer_params": kv,
    }
    req = parse_generate_request(body)
    assert req.kv_transfer_params == kv and "kv_transfer_params" not in req.extra
    assert generate_request_to_json(req)["kv_transfer_params"] == kv
    text = kv_transfer_params_text(req)
    pre = PrefillEvent("r-kv", "m", [1, 2, 3], Features({}, {}), kv_transfer_params=text)
    ev = DecodeEvent(pre, kv_transfer_params=text)
    back = get_codec().decode(get_codec().encode(ev))
    assert kv_transfer_params_from_text(back.kv_transfer_params) == kv
    assert kv_transfer_params_from_text(back.prefill.kv_transfer_params) == kv
    with pytest.raises(ValidationError) as err:
        parse_generate_request({**body, "kv_transfer_params": [1]})
    assert err.value.rule == "request-shape"
