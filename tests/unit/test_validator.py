"""Unit tests of the safety gate: every rule, both modes, accepting and rejecting cases."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from runtime.settings import Settings
from schemas.errors import ValidationError
from schemas.signing import make_ec_transfer
from schemas.types import (
    ECTransfer,
    EncodeEvent,
    Features,
    ItemData,
    PlaceholderRange,
    PrefillEvent,
    RenderEvent,
    TensorRef,
)
from schemas.validator import (
    ValidationConfig,
    find_ec_entry,
    validate_encode_event,
    validate_features,
    validate_prefill_event,
    validate_render_event,
    validate_render_slots,
)

STRICT = ValidationConfig()
VLLM = ValidationConfig(mode="vllm")
SECRET = b"unit-test-secret"


def grid(t: int = 1, h: int = 4, w: int = 4) -> torch.Tensor:
    return torch.tensor([t, h, w], dtype=torch.int64)


def image_full(t: int = 1, h: int = 4, w: int = 4) -> ItemData:
    g = grid(t, h, w)
    return {"pixel_values": torch.randn(t * h * w, 8), "image_grid_thw": g}


def image_meta(t: int = 1, h: int = 4, w: int = 4) -> ItemData:
    return {"image_grid_thw": grid(t, h, w)}


def video_full() -> ItemData:
    return {"pixel_values_videos": torch.randn(2 * 4 * 4, 8), "video_grid_thw": grid(2, 4, 4)}


def video_meta() -> ItemData:
    return {"video_grid_thw": grid(2, 4, 4)}


def feats(
    spec: dict[str, list[tuple[int, int, ItemData | None, ItemData | None]]],
    *,
    meta_none: bool = False,
    kwargs_none: bool = False,
) -> Features:
    """Features from {modality: [(offset, length, full, meta), ...]}; hashes are m{i}."""
    return Features(
        mm_hashes={m: [f"{m}-h{i}" for i in range(len(v))] for m, v in spec.items()},
        mm_placeholders={m: [PlaceholderRange(o, n) for o, n, _, _ in v] for m, v in spec.items()},
        kwargs_data=None if kwargs_none else {m: [f for _, _, f, _ in v] for m, v in spec.items()},
        mm_metadata=None if meta_none else {m: [md for _, _, _, md in v] for m, v in spec.items()},
    )


def ec_for(features: Features, secret: bytes | None = None, **kw: Any) -> dict[str, ECTransfer]:
    out = {}
    for _m, _i, h in features.items():
        args: dict[str, Any] = {
            "mm_hash": h,
            "store": "redis://x",
            "key": f"ec:fp:{h}",
            "expires_ms": 10**13,
            "secret": secret,
        }
        args.update(kw)
        out[h] = make_ec_transfer(**args)
    return out


def reject(rule: str, *args: Any, modality: str | None = None, item: int | None = None) -> Any:
    with pytest.raises(ValidationError) as ei:
        validate_features(*args)
    e = ei.value
    assert e.rule == rule, str(e)
    if modality is not None:
        assert e.modality == modality, str(e)
    if item is not None:
        assert e.item == item, str(e)
    return e


TOKENS = list(range(40))


# --------------------------------------------------------------------------- token ids


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
@pytest.mark.parametrize("bad", [[], [1, -1, 2], [1, 1.5], [1, "x"], [None], [1, "-1"]])
def test_token_ids_rejected(cfg: ValidationConfig, bad: list[Any]) -> None:
    reject("token-ids", bad, None, None, cfg)


@pytest.mark.parametrize("coercible", [[1, True], [1, "2"], [1.0], [" 3 "]])
def test_token_ids_vllm_coerces_like_pydantic_strict_does_not(coercible: list[Any]) -> None:
    """Defect 5: vLLM's pydantic lax mode reads 1.0, true and "0" as ints; strict does not."""
    validate_features(coercible, None, None, VLLM)
    reject("token-ids", coercible, None, None, STRICT)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_text_only_accepted(cfg: ValidationConfig) -> None:
    validate_features([0, 1, 2], None, None, cfg)


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_valid_metadata_only_image_accepted(cfg: ValidationConfig) -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    validate_features(TOKENS, f, ec_for(f), cfg)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_modality_keys_placeholders(cfg: ValidationConfig) -> None:
    f = feats({"image": [(2, 4, image_full(), None)]})
    f.mm_placeholders["audio"] = [PlaceholderRange(10, 3)]
    reject("modality-keys", TOKENS, f, None, cfg, modality="audio")


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_modality_keys_metadata_omits_modality(cfg: ValidationConfig) -> None:
    # vLLM 0.33's render shape: the modality without metadata is left out of mm_metadata.
    f = feats({"image": [(2, 4, None, image_meta())], "video": [(10, 8, video_full(), None)]})
    assert f.mm_metadata is not None
    del f.mm_metadata["video"]
    reject("modality-keys", TOKENS, f, ec_for(f), cfg, modality="video")


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_modality_keys_kwargs(cfg: ValidationConfig) -> None:
    f = feats({"image": [(2, 4, image_full(), None)]})
    assert f.kwargs_data is not None
    f.kwargs_data["video"] = []
    reject("modality-keys", TOKENS, f, None, cfg, modality="video")


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
@pytest.mark.parametrize("slot", ["mm_placeholders", "kwargs_data", "mm_metadata"])
def test_item_count(cfg: ValidationConfig, slot: str) -> None:
    f = feats({"image": [(2, 4, image_full(), None), (8, 4, image_full(), None)]})
    getattr(f, slot)["image"].pop()
    e = reject("item-count", TOKENS, f, None, cfg, modality="image")
    assert e.field == slot


@pytest.mark.parametrize(
    ("offset", "length", "is_embed", "vllm_rejects"),
    [
        (-1, 4, None, True),
        (0, 0, None, True),
        (38, 4, None, True),
        (2, 1.5, None, True),
        (True, 4, None, False),  # vLLM's pydantic reads true as 1
        ("2", 4.0, None, False),
        (2, 4, [True, False], False),  # vLLM 0.33 drops is_embed: no such field there
    ],
)
def test_placeholder_range(offset: Any, length: Any, is_embed: Any, vllm_rejects: bool) -> None:
    f = feats({"image": [(0, 4, image_full(), None), (2, 4, image_full(), None)]})
    f.mm_placeholders["image"][0] = PlaceholderRange(20, 4)
    f.mm_placeholders["image"][1] = PlaceholderRange(offset, length, is_embed)
    reject("placeholder-range", TOKENS, f, None, STRICT, modality="image", item=1)
    if vllm_rejects:
        reject("placeholder-range", TOKENS, f, None, VLLM, modality="image", item=1)
    else:
        validate_features(TOKENS, f, None, VLLM)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_placeholder_overlap_across_modalities(cfg: ValidationConfig) -> None:
    f = feats({"image": [(10, 4, image_full(), None)], "video": [(12, 8, video_full(), None)]})
    reject("placeholder-overlap", TOKENS, f, None, cfg, modality="video", item=0)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_placeholders_touching_and_unsorted_accepted(cfg: ValidationConfig) -> None:
    # Listed out of order and touching: vLLM sorts before checking, and touching is fine.
    f = feats({"image": [(14, 4, image_full(), None), (10, 4, image_full(), None)]})
    f.mm_placeholders["video"] = [PlaceholderRange(18, 8)]
    f.mm_hashes["video"] = ["v0"]
    assert f.kwargs_data is not None and f.mm_metadata is not None
    f.kwargs_data["video"] = [video_full()]
    f.mm_metadata["video"] = [None]
    validate_features(TOKENS, f, None, cfg)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_placeholder_ending_exactly_at_tokens_end_accepted(cfg: ValidationConfig) -> None:
    f = feats({"image": [(36, 4, image_full(), None)]})
    validate_features(TOKENS, f, None, cfg)


# --------------------------------------------------------------------------- per-item EC safety


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_image_video_only_one_modality_has_metadata(cfg: ValidationConfig) -> None:
    f = feats({"image": [(2, 4, None, image_meta())], "video": [(10, 8, video_full(), None)]})
    validate_features(TOKENS, f, ec_for(f), cfg)
    # Without EC params the metadata-only image is unsafe, even though video has full data.
    reject("ec-transfer-required", TOKENS, f, None, cfg, modality="image", item=0)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_video_metadata_only_image_full(cfg: ValidationConfig) -> None:
    f = feats({"image": [(2, 4, image_full(), None)], "video": [(10, 8, None, video_meta())]})
    validate_features(TOKENS, f, ec_for(f), cfg)
    reject("ec-transfer-required", TOKENS, f, {}, cfg, modality="video", item=0)


@pytest.mark.parametrize("cfg", [STRICT, VLLM])
def test_full_item_does_not_excuse_metadata_only_item(cfg: ValidationConfig) -> None:
    f = feats({"image": [(2, 4, image_full(), None), (8, 4, None, image_meta())]})
    reject("ec-transfer-required", TOKENS, f, None, cfg, modality="image", item=1)


def test_both_none_slot_vllm_accepts_strict_needs_entry() -> None:
    f = feats({"image": [(2, 4, image_full(), None), (8, 4, None, None)]})
    validate_features(TOKENS, f, None, VLLM)  # processor-cache hit in vLLM
    reject("ec-transfer-required", TOKENS, f, None, STRICT, modality="image", item=1)
    validate_features(TOKENS, f, ec_for(f), STRICT)


def test_kwargs_data_null_both_none_all_items() -> None:
    f = feats({"image": [(2, 4, None, None)]}, kwargs_none=True, meta_none=True)
    validate_features(TOKENS, f, None, VLLM)
    reject("ec-transfer-required", TOKENS, f, None, STRICT, modality="image", item=0)


def test_strict_entry_must_match_the_item_hash() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    other = {"other-hash": {"transfer_id": "t"}}
    validate_features(TOKENS, f, other, VLLM)  # vLLM only asks for ec_transfer_params at all
    reject("ec-transfer-required", TOKENS, f, other, STRICT, modality="image", item=0)


def test_strict_finds_entry_in_ec_items_shape() -> None:
    f = feats({"image": [(2, 4, None, image_meta()), (8, 4, None, image_meta())]})
    params = {
        "ec_items": [{"mm_hash": "image-h1", "tid": "1"}, {"mm_hash": "image-h0", "tid": "0"}]
    }
    validate_features(TOKENS, f, params, STRICT)
    params = {"ec_items": [{"mm_hash": "image-h0", "tid": "0"}]}
    reject("ec-transfer-required", TOKENS, f, params, STRICT, modality="image", item=1)


def test_find_ec_entry_shapes() -> None:
    ec = ECTransfer("h", "s", "ec:k", 1)
    assert find_ec_entry({"h": ec}, "h") is ec
    assert find_ec_entry({"h": {"x": 1}}, "h") == {"x": 1}
    assert find_ec_entry({"ec_items": [{"mm_hash": "g"}, {"mm_hash": "h", "a": 2}]}, "h") == {
        "mm_hash": "h",
        "a": 2,
    }
    assert find_ec_entry({"ec_items": [ec]}, "h") is ec
    assert find_ec_entry({"ec_items": [{"mm_hash": "g"}]}, "h") is None
    assert find_ec_entry(None, "h") is None
    assert find_ec_entry({}, "h") is None


# --------------------------------------------------------------------------- metadata rules


def test_pixel_values_in_metadata() -> None:
    f = feats({"image": [(2, 4, None, image_full())]})
    e = reject("metadata-field", TOKENS, f, ec_for(f), STRICT, modality="image", item=0)
    assert e.field == "pixel_values"
    validate_features(TOKENS, f, ec_for(f), VLLM)


def test_metadata_missing_grid() -> None:
    f = feats({"image": [(2, 4, None, {"second_per_grid_ts": torch.tensor([1.0])})]})
    e = reject("metadata-missing", TOKENS, f, ec_for(f), STRICT, modality="image", item=0)
    assert e.field == "image_grid_thw"
    validate_features(TOKENS, f, ec_for(f), VLLM)


def test_metadata_missing_video_grid() -> None:
    f = feats({"video": [(2, 8, {"pixel_values_videos": torch.randn(32, 8)}, None)]})
    reject("metadata-missing", TOKENS, f, None, STRICT, modality="video", item=0)


def test_required_metadata_is_a_setting() -> None:
    f = feats({"image": [(2, 4, None, {"second_per_grid_ts": torch.tensor([1.0])})]})
    cfg = ValidationConfig(required_metadata={})
    validate_features(TOKENS, f, ec_for(f), cfg)


# --------------------------------------------------------------------------- grid consistency


def test_placeholder_length_must_match_grid() -> None:
    f = feats({"image": [(2, 5, None, image_meta())]})  # grid 1x4x4 / 2^2 = 4, not 5
    e = reject("grid-consistency", TOKENS, f, ec_for(f), STRICT, modality="image", item=0)
    assert e.field == "image_grid_thw"
    validate_features(TOKENS, f, ec_for(f), VLLM)


def test_grid_uses_is_embed_count() -> None:
    f = feats({"image": [(2, 6, None, image_meta())]})
    f.mm_placeholders["image"][0].is_embed = [False, True, True, True, True, False]
    validate_features(TOKENS, f, ec_for(f), STRICT)
    f.mm_placeholders["image"][0].is_embed = [False, True, True, True, True, True]
    reject("grid-consistency", TOKENS, f, ec_for(f), STRICT)


def test_merge_size_is_a_setting() -> None:
    f = feats({"image": [(2, 16, None, image_meta())]})
    reject("grid-consistency", TOKENS, f, ec_for(f), STRICT)
    validate_features(TOKENS, f, ec_for(f), ValidationConfig(merge_size=1))


def test_video_grid_consistency() -> None:
    f = feats({"video": [(2, 8, None, video_meta())]})  # 2*4*4/4 = 8
    validate_features(TOKENS, f, ec_for(f), STRICT)
    f = feats({"video": [(2, 9, None, video_meta())]})
    reject("grid-consistency", TOKENS, f, ec_for(f), STRICT, modality="video", item=0)


@pytest.mark.parametrize(
    "g",
    [
        torch.tensor([1.0, 4.0, 4.0]),
        torch.tensor([0, 4, 4]),
        torch.tensor([1, 3, 4]),
        torch.tensor([1, 4]),
        torch.tensor([], dtype=torch.int64),
    ],
)
def test_bad_grids(g: torch.Tensor) -> None:
    f = feats({"image": [(2, 4, None, {"image_grid_thw": g})]})
    reject("grid-consistency", TOKENS, f, ec_for(f), STRICT, modality="image", item=0)


def test_grid_2d_row_accepted() -> None:
    f = feats({"image": [(2, 4, None, {"image_grid_thw": torch.tensor([[1, 4, 4]])})]})
    validate_features(TOKENS, f, ec_for(f), STRICT)


def test_grid_claim_check_rejected() -> None:
    ref = TensorRef("redis://x", "k", "int64", [3], 24, "d")
    f = feats({"image": [(2, 4, None, {"image_grid_thw": ref})]})
    reject("grid-consistency", TOKENS, f, ec_for(f), STRICT)


def test_pixel_rows_must_match_grid() -> None:
    full = {"pixel_values": torch.randn(15, 8), "image_grid_thw": grid()}
    f = feats({"image": [(2, 4, full, None)]})
    e = reject("grid-consistency", TOKENS, f, None, STRICT, modality="image", item=0)
    assert e.field == "pixel_values"
    validate_features(TOKENS, f, None, VLLM)


def test_full_data_with_separate_metadata_accepted() -> None:
    f = feats({"image": [(2, 4, {"pixel_values": torch.randn(16, 8)}, image_meta())]})
    validate_features(TOKENS, f, None, STRICT)


# --------------------------------------------------------------------------- tensors


def test_nan_and_inf_rejected() -> None:
    for bad in (float("nan"), float("inf")):
        full = image_full()
        full["pixel_values"][3, 2] = bad
        f = feats({"image": [(2, 4, full, None)]})
        e = reject("tensor-nonfinite", TOKENS, f, None, STRICT, modality="image", item=0)
        assert e.field == "pixel_values"
        validate_features(TOKENS, f, None, VLLM)
        # the fan-out's structure-only config skips the value scan (the encoder does it)
        validate_features(TOKENS, f, None, dataclasses.replace(STRICT, check_values=False))


def test_bf16_inputs_accepted() -> None:
    full = image_full()
    full["pixel_values"] = full["pixel_values"].to(torch.bfloat16)
    validate_features(TOKENS, feats({"image": [(2, 4, full, None)]}), None, STRICT)


def test_dtype_not_allowed() -> None:
    f = feats({"image": [(2, 4, image_full(), None)]})
    cfg = ValidationConfig(allowed_dtypes=frozenset({"int64", "bfloat16"}))
    e = reject("tensor", TOKENS, f, None, cfg, modality="image", item=0)
    assert e.field == "pixel_values"


def test_tensor_size_limit() -> None:
    f = feats({"image": [(2, 4, image_full(), None)]})
    reject("tensor", TOKENS, f, None, ValidationConfig(max_tensor_bytes=100))
    validate_features(TOKENS, f, None, ValidationConfig(max_tensor_bytes=16 * 8 * 4))


def test_tensor_ref_checked_by_shape_and_nbytes() -> None:
    ok = TensorRef("redis://x", "k", "float32", [16, 8], 16 * 8 * 4, "d")
    f = feats({"image": [(2, 4, {"pixel_values": ok, "image_grid_thw": grid()}, None)]})
    validate_features(TOKENS, f, None, STRICT)
    bad = TensorRef("redis://x", "k", "float32", [16, 8], 100, "d")
    f = feats({"image": [(2, 4, {"pixel_values": bad, "image_grid_thw": grid()}, None)]})
    reject("tensor", TOKENS, f, None, STRICT, modality="image", item=0)
    rows = TensorRef("redis://x", "k", "float32", [12, 8], 12 * 8 * 4, "d")
    f = feats({"image": [(2, 4, {"pixel_values": rows, "image_grid_thw": grid()}, None)]})
    reject("grid-consistency", TOKENS, f, None, STRICT)
    big = TensorRef("redis://x", "k", "float32", [16, 8], 16 * 8 * 4, "d")
    f = feats({"image": [(2, 4, {"pixel_values": big, "image_grid_thw": grid()}, None)]})
    reject("tensor", TOKENS, f, None, ValidationConfig(max_tensor_bytes=64))


# --------------------------------------------------------------------------- EC entries


def test_signed_entries_accepted_and_forgery_rejected() -> None:
    cfg = ValidationConfig(secret=SECRET, now_ms=lambda: 1000)
    f = feats({"image": [(2, 4, None, image_meta())]})
    validate_features(TOKENS, f, ec_for(f, SECRET), cfg)
    forged = ec_for(f, b"wrong-secret")
    reject("ec-signature", TOKENS, f, forged, cfg, modality="image", item=0)
    # A re-pointed key with the old signature does not verify either.
    tampered = ec_for(f, SECRET)
    tampered["image-h0"].key = "ec:another-model:image-h0"
    reject("ec-signature", TOKENS, f, tampered, cfg)


@pytest.mark.parametrize(
    "key",
    [
        "ec:fp:someone-else",  # another item's (or tenant's) embeddings
        "ec:claim:image-h0:pixel_values",  # claim-checked encoder inputs
        "ec::image-h0",  # no model fingerprint
        "ec:fp:x:image-h0",  # extra segment
    ],
)
def test_entry_key_must_be_this_items_embedding_key(key: str) -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    for secret in (None, SECRET):
        entries = ec_for(f, secret)
        entries["image-h0"].key = key
        # Signed, a key whose hash is not the label is the fan-out's own content hash (a vLLM
        # render's foreign label): allowed in form, so a tampered one fails on its signature.
        rule = "ec-signature" if secret and key == "ec:fp:someone-else" else "ec-key"
        reject(rule, TOKENS, f, entries, ValidationConfig(secret=secret), item=0)


def test_signed_entry_may_key_a_foreign_label_by_our_own_hash() -> None:
    """A vLLM render's label stays the label; the signed key names the fan-out's own hash."""
    f = feats({"image": [(2, 4, None, image_meta())]})
    entries = ec_for(f, SECRET, key="ec:fp:" + "a" * 64)
    validate_features(TOKENS, f, entries, ValidationConfig(secret=SECRET))
    unsigned = ec_for(f, None, key="ec:fp:" + "a" * 64)
    reject("ec-key", TOKENS, f, unsigned, ValidationConfig(), item=0)


def test_pinned_model_fingerprint() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    entries = ec_for(f, None)
    model = entries["image-h0"].key.split(":")[1]
    validate_features(TOKENS, f, entries, ValidationConfig(model_fingerprint=model))
    reject("ec-key", TOKENS, f, entries, ValidationConfig(model_fingerprint="other"), item=0)


def test_signed_entries_as_raw_dicts() -> None:
    cfg = ValidationConfig(secret=SECRET)
    f = feats({"image": [(2, 4, None, image_meta())]})
    raw = {
        h: {
            "mm_hash": e.mm_hash,
            "store": e.store,
            "key": e.key,
            "expires_ms": e.expires_ms,
            "signature": e.signature,
        }
        for h, e in ec_for(f, SECRET).items()
    }
    validate_features(TOKENS, f, raw, cfg)
    validate_features(TOKENS, f, {"ec_items": list(raw.values())}, cfg)
    raw["image-h0"]["signature"] = "00" * 32
    reject("ec-signature", TOKENS, f, raw, cfg)


def test_unsigned_connector_entry_needs_fields_when_secret_set() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    params = {"ec_items": [{"mm_hash": "image-h0", "transfer_id": "t"}]}
    validate_features(TOKENS, f, params, STRICT)
    reject("ec-entry", TOKENS, f, params, ValidationConfig(secret=SECRET))
    validate_features(TOKENS, f, params, ValidationConfig(mode="vllm", secret=SECRET))


def test_entry_key_outside_namespace() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    params = ec_for(f, SECRET, key="other:fp:image-h0")
    reject("ec-namespace", TOKENS, f, params, STRICT, modality="image", item=0)
    reject("ec-namespace", TOKENS, f, params, ValidationConfig(secret=SECRET))
    validate_features(TOKENS, f, params, ValidationConfig(namespace="other", secret=SECRET))
    validate_features(TOKENS, f, params, VLLM)
    raw = {"image-h0": {"key": "other:x"}}
    reject("ec-namespace", TOKENS, f, raw, STRICT)


def test_entry_for_other_hash_under_this_key() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    e = make_ec_transfer(
        mm_hash="evil", store="s", key="ec:fp:evil", expires_ms=10**13, secret=None
    )
    reject("ec-entry", TOKENS, f, {"image-h0": e}, STRICT, modality="image", item=0)


def test_expired_entry() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    params = ec_for(f, SECRET, expires_ms=5000)
    validate_features(TOKENS, f, params, ValidationConfig(secret=SECRET, now_ms=lambda: 4999))
    reject("ec-expired", TOKENS, f, params, ValidationConfig(secret=SECRET, now_ms=lambda: 5000))
    validate_features(TOKENS, f, params, ValidationConfig(secret=SECRET))  # no clock, no check


def test_prefill_expiry_alone_names_the_item_and_checks_every_entry() -> None:
    from schemas.validator import validate_prefill_expiry

    f = feats({"image": [(2, 4, None, image_meta())]})
    params = ec_for(f, SECRET, request_id="r", expires_ms=5000)
    ev = PrefillEvent("r", "m", TOKENS, f, ec_transfer_params=params)
    validate_prefill_event(ev, ValidationConfig(secret=SECRET))  # all but the expiry: fine
    validate_prefill_expiry(ev, ValidationConfig(secret=SECRET, now_ms=lambda: 4999))
    validate_prefill_expiry(ev, ValidationConfig(secret=SECRET))  # no clock, no check
    with pytest.raises(ValidationError) as err:
        validate_prefill_expiry(ev, ValidationConfig(secret=SECRET, now_ms=lambda: 5000))
    assert (err.value.rule, err.value.modality, err.value.item) == ("ec-expired", "image", 0)
    # An entry no item refers to is held to its expiry too, as the full validation holds it.
    (entry,) = params.values()
    stray = dataclasses.replace(entry, mm_hash="stray", expires_ms=100)
    ev = PrefillEvent("r", "m", TOKENS, f, ec_transfer_params={**params, "stray": stray})
    with pytest.raises(ValidationError) as err:
        validate_prefill_expiry(ev, ValidationConfig(secret=SECRET, now_ms=lambda: 4999))
    assert (err.value.rule, err.value.modality) == ("ec-expired", None)


def test_entries_of_full_items_are_checked_too() -> None:
    f = feats({"image": [(2, 4, image_full(), None)]})
    reject("ec-signature", TOKENS, f, ec_for(f, b"bad"), ValidationConfig(secret=SECRET))


def test_vllm_mode_ignores_signatures() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    validate_features(TOKENS, f, ec_for(f, b"bad"), ValidationConfig(mode="vllm", secret=SECRET))


# --------------------------------------------------------------------------- events


def test_prefill_event() -> None:
    f = feats({"image": [(2, 4, None, image_meta())]})
    cfg = ValidationConfig(secret=SECRET, now_ms=lambda: 0)
    # Signatures bind the request: entries are signed for the event's request id.
    ev = PrefillEvent("r", "m", TOKENS, f, ec_transfer_params=ec_for(f, SECRET, request_id="r"))
    validate_prefill_event(ev, cfg)
    # An extra, forged entry that no item uses is still rejected.
    ev.ec_transfer_params["stray"] = make_ec_transfer(
        mm_hash="stray", store="s", key="ec:fp:stray", expires_ms=10**13, secret=b"no"
    )
    with pytest.raises(ValidationError) as ei:
        validate_prefill_event(ev, cfg)
    assert ei.value.rule == "ec-signature"
    ev = PrefillEvent("r", "m", TOKENS, f)
    with pytest.raises(ValidationError) as ei:
        validate_prefill_event(ev, cfg)
    assert (ei.value.rule, ei.value.modality, ei.value.item) == ("ec-transfer-required", "image", 0)


def test_prefill_event_needs_an_entry_even_for_items_with_full_data() -> None:
    # A prefill worker never encodes: kwargs_data in a PrefillEvent cannot stand in for an entry.
    f = feats({"image": [(2, 4, image_full(), image_meta())]})
    validate_features(TOKENS, f, None, STRICT)  # fine as a generic request
    with pytest.raises(ValidationError) as ei:
        validate_prefill_event(PrefillEvent("r", "m", TOKENS, f), STRICT)
    assert (ei.value.rule, ei.value.modality, ei.value.item) == ("ec-transfer-required", "image", 0)


def test_prefill_event_needs_the_grid_in_mm_metadata() -> None:
    # Positions come from mm_metadata: an item with neither slot, or metadata without the grid,
    # is rejected before the worker waits for anything.
    for f in (
        feats({"image": [(2, 4, None, None)]}, meta_none=True),
        feats({"image": [(2, 4, image_full(), None)]}),
    ):
        ev = PrefillEvent("r", "m", TOKENS, f, ec_transfer_params=ec_for(f))
        with pytest.raises(ValidationError) as ei:
            validate_prefill_event(ev, STRICT)
        assert (ei.value.rule, ei.value.item, ei.value.field) == (
            "metadata-missing",
            0,
            "image_grid_thw",
        )


def _encode_event(data: ItemData, secret: bytes | None = SECRET, **kw: Any) -> EncodeEvent:
    ec = make_ec_transfer(
        mm_hash="h", store="s", key="ec:fp:h", expires_ms=10**13, secret=secret, request_id="r"
    )
    args: dict[str, Any] = {
        "request_id": "r",
        "model": "m",
        "modality": "image",
        "item_index": 0,
        "mm_hash": "h",
        "data": data,
        "ec_transfer": ec,
    }
    args.update(kw)
    return EncodeEvent(**args)


def test_encode_event() -> None:
    cfg = ValidationConfig(secret=SECRET)
    validate_encode_event(_encode_event(image_full()), cfg)
    cases: list[tuple[EncodeEvent, str]] = [
        (_encode_event(image_meta()), "encode-inputs"),
        (_encode_event({"pixel_values": torch.randn(16, 8)}), "metadata-missing"),
        (
            _encode_event({"pixel_values": torch.randn(12, 8), "image_grid_thw": grid()}),
            "grid-consistency",
        ),
        (_encode_event(image_full(), secret=b"bad"), "ec-signature"),
        (_encode_event(image_full(), mm_hash="other"), "ec-entry"),
        (_encode_event(image_full(), item_index=-1), "encode-inputs"),
        (
            _encode_event(
                {"pixel_values": torch.full((16, 8), float("nan")), "image_grid_thw": grid()}
            ),
            "tensor-nonfinite",
        ),
    ]
    for ev, rule in cases:
        with pytest.raises(ValidationError) as ei:
            validate_encode_event(ev, cfg)
        assert ei.value.rule == rule, str(ei.value)
        assert ei.value.modality == "image"


def test_render_slots_across_modalities() -> None:
    f = Features(
        mm_hashes={"image": ["a"], "audio": ["b"]},
        mm_placeholders={"image": [PlaceholderRange(0, 4)], "audio": [PlaceholderRange(4, 4)]},
        kwargs_data={"image": [image_full()], "audio": [{"input_features": torch.randn(4, 2)}]},
        mm_metadata={"image": [image_meta()]},
    )
    with pytest.raises(ValidationError) as ei:
        validate_render_slots(f)
    assert (ei.value.rule, ei.value.modality) == ("slots-across-modalities", "audio")
    f.mm_metadata = {"image": [image_meta()], "audio": []}
    with pytest.raises(ValidationError):
        validate_render_slots(f)
    f.mm_metadata = {"image": [image_meta()], "audio": [None]}
    validate_render_slots(f)
    f.mm_metadata = None
    validate_render_slots(f)


def test_render_event() -> None:
    f = feats(
        {"image": [(2, 4, image_full(), image_meta())], "video": [(10, 8, video_full(), None)]}
    )
    ev = RenderEvent("r", "m", TOKENS, f)
    validate_render_event(ev)
    assert f.kwargs_data is not None
    f.kwargs_data["video"][0] = None
    with pytest.raises(ValidationError) as ei:
        validate_render_event(ev)
    assert (ei.value.rule, ei.value.modality, ei.value.item) == ("render-data-missing", "video", 0)
    f2 = feats(
        {"image": [(2, 4, image_full(), image_meta())], "video": [(10, 8, video_full(), None)]}
    )
    assert f2.mm_metadata is not None
    del f2.mm_metadata["video"]
    with pytest.raises(ValidationError) as ei:
        validate_render_event(RenderEvent("r", "m", TOKENS, f2))
    assert ei.value.rule == "slots-across-modalities"


def test_config_from_settings() -> None:
    s = Settings(
        ec_secret="abc",
        ec_namespace="tenant",
        spatial_merge_size=1,
        validation_mode="vllm",
        max_tensor_bytes=123,
    )
    cfg = ValidationConfig.from_settings(s)
    assert (cfg.mode, cfg.secret, cfg.namespace, cfg.merge_size, cfg.max_tensor_bytes) == (
        "vllm",
        b"abc",
        "tenant",
        1,
        123,
    )
    assert cfg.now_ms is not None
    cfg = ValidationConfig.from_settings(s, mode="strict", merge_size=None)
    assert (cfg.mode, cfg.merge_size) == ("strict", 1)


def test_worker_gate_is_strict_and_pinned_whatever_the_setting() -> None:
    from runtime.settings import Settings

    cfg = ValidationConfig.for_worker(Settings(validation_mode="vllm"), "fp1")
    assert (cfg.mode, cfg.model_fingerprint) == ("strict", "fp1")


def test_all_finite_takes_the_fast_sum_only_when_it_settles_the_question() -> None:
    from schemas.validator import all_finite

    t = torch.randn(64, 32)
    assert all_finite(t)
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[7, 3] = bad
        assert not all_finite(u)
    both = t.clone()
    both[0, 0], both[1, 1] = float("inf"), float("-inf")  # their sum is NaN, not a finite value
    assert not all_finite(both)
    # Large finite values overflow the sum; the exact test still says they are finite.
    big = torch.full((1024,), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(big.sum()) and all_finite(big)
    assert all_finite(torch.full((8,), 3e38)) and not torch.isfinite(torch.full((8,), 3e38).sum())
