"""The safety gate (docs/design.md, "Validation rules"), in ``strict`` and ``vllm`` modes.

Every rejection is a :class:`schemas.errors.ValidationError` naming the rule (a stable slug
below), the modality, the item index and, where one applies, the field.

Rules (slug: what it rejects):

- ``request-shape``: a vLLM JSON body whose structure is not a ``GenerateRequest`` (raised by
  :mod:`schemas.vllm_rules` and :mod:`schemas.vllm_wire` while parsing).
- ``token-ids``: empty ``token_ids``, or an id that is not a non-negative int (``vllm`` mode
  coerces ``1.0``, ``true``, ``"0"`` as vLLM's pydantic does).
- ``modality-keys``: ``mm_placeholders``, ``kwargs_data`` (when not null) or ``mm_metadata``
  (when not null) with modality keys other than those of ``mm_hashes``.
- ``item-count``: a per-modality list whose length differs from ``mm_hashes[modality]``.
- ``placeholder-range``: offset < 0, length <= 0, non-int values, a range that ends past
  ``token_ids``, and (``strict`` only; vLLM 0.33 ignores the field) an ``is_embed`` mask whose
  size is not ``length``.
- ``placeholder-overlap``: two ranges (of any modalities) that overlap once sorted by offset;
  touching is fine, as in vLLM.
- ``ec-transfer-required``: an item that cannot get its embedding. ``vllm`` mode: an item with
  metadata and no data while the request has no (or an empty) top-level
  ``ec_transfer_params`` (vLLM's "metadata-only multimodal items require ec_transfer_params";
  an item with neither is a processor-cache hit there). ``strict`` mode, per item: without
  its own entry an item must carry its encoder inputs (``pixel_values``...); a ``kwargs_data``
  slot holding only the grid is not full data.
- ``ec-entry``: an entry that points nowhere (``{}``, ``false``, ``""``, ``{"mm_hash": h}``
  alone), one not ECTransfer-shaped while signatures are required, or one whose ``mm_hash``
  differs from the item's.
- ``ec-namespace``: an entry key outside ``{namespace}:``.
- ``ec-key``: an entry key that is not ``{namespace}:{model_fingerprint}:{mm_hash}`` for its
  item (the fingerprint is pinned when the config names one).
- ``ec-signature``: an entry whose HMAC does not verify (only when a secret is configured).
- ``ec-store``: an entry naming another embedding store than the one this worker reads (only
  when the config names one: the workers' gates do). A worker whose ``EPD_STORE_URL`` differs
  from the fan-out's would otherwise wait in vain for embeddings parked elsewhere.
- ``ec-expired``: an entry whose ``expires_ms`` has passed (only when ``now_ms`` is set).
- ``metadata-field``: ``mm_metadata`` holding a field that is not a metadata field (e.g.
  ``pixel_values``).
- ``metadata-missing``: an item without a field the model needs (``image_grid_thw`` for
  Qwen2-VL images).
- ``grid-consistency``: a bad grid (non-integer, non-positive, not a multiple of the merge
  size), a placeholder whose embedding count is not ``t*h*w / merge**2``, encoder inputs
  whose row count is not ``t*h*w``, or a grid in ``kwargs_data`` that differs from the one in
  ``mm_metadata`` (the encoder would read one, M-RoPE the other).
- ``metadata-consistency``: another metadata field present in both slots with other values.
- ``encode-inputs``: an encode event without its encoder input field.
- ``tensor``: a disallowed dtype, a bad shape, a size mismatch, a tensor over the size limit,
  or an undecodable vLLM item (in ``vllm`` mode: one vLLM's own decoder would fail on).
- ``tensor-nonfinite``: a floating-point input holding NaN or Inf.
- ``slots-across-modalities``: (render side) some item has metadata but ``mm_metadata`` lacks a
  full-length list for some modality of ``mm_hashes``.
- ``render-data-missing``: a render event item without its encoder inputs in ``kwargs_data``.
- ``kv-key``, ``kv-signature``, ``kv-store``, ``kv-shape``, ``kv-transfer-params``: the decode
  stage's rules (:mod:`schemas.kv_entries`, ``validate_decode_event``).

``vllm`` applies exactly what vLLM 0.33's ``/inference/v1/generate`` applies (on JSON,
:func:`schemas.vllm_rules.check_vllm_request`: its field types, cross-field checks and item
decoding). ``strict`` applies all rules, and on JSON checks vLLM's first, so it never accepts
what vLLM refuses.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from schemas import tensor_ops

# Re-exported: the gate's public surface stays in one module for its callers.
from schemas.ec_entries import (
    check_ec_entry,
    check_ec_expiry,
    check_ec_key,
    entry_locates_embedding,
    find_ec_entry,
    short_repr,
)
from schemas.errors import ValidationError
from schemas.kv_entries import KVShape, check_kv_entry, check_kv_transfer_params
from schemas.modalities import GRID_FIELDS, MAIN_ENCODER_INPUT
from schemas.types import (
    DTYPE_SIZES,
    DecodeEvent,
    EncodeEvent,
    Features,
    ItemData,
    PrefillEvent,
    RenderEvent,
    TensorLike,
    TensorRef,
)
from schemas.validation_config import DEFAULT_METADATA_FIELDS, Mode, ValidationConfig
from schemas.values import is_int

__all__ = [
    "DEFAULT_METADATA_FIELDS",
    "GRID_FIELDS",
    "Mode",
    "ValidationConfig",
    "carries_encoder_inputs",
    "check_agreement",
    "check_ec_entry",
    "check_ec_expiry",
    "check_ec_key",
    "check_item_data",
    "check_item_source",
    "check_structure",
    "check_tensor",
    "check_token_ids",
    "entry_locates_embedding",
    "find_ec_entry",
    "grid_patches",
    "validate_decode_event",
    "validate_encode_event",
    "validate_features",
    "validate_prefill_event",
    "validate_prefill_expiry",
    "validate_render_event",
    "validate_render_slots",
]

# ---------------------------------------------------------------------------------------------
# Structure


_LAX_INT: pydantic.TypeAdapter[int] = pydantic.TypeAdapter(int)


def _as_int(x: Any, lax: bool) -> int | None:
    """``x`` as an int, or None. ``lax`` is vLLM's reading: its pydantic models coerce ``1.0``,
    ``True`` and ``"0"`` to ints (lax mode); strict takes only real ints."""
    if is_int(x):
        return int(x)
    if not lax:
        return None
    try:
        return _LAX_INT.validate_python(x)
    except pydantic.ValidationError:
        return None


def check_token_ids(token_ids: Sequence[Any], *, lax: bool = False) -> None:
    """Rule ``token-ids``: non-empty, every id a non-negative int (``lax``: vLLM's coercion)."""
    if not isinstance(token_ids, Sequence) or len(token_ids) == 0:
        raise ValidationError("token-ids", "token_ids must be a non-empty list")
    for i, t in enumerate(token_ids):
        v = _as_int(t, lax)
        if v is None or v < 0:
            raise ValidationError("token-ids", f"token_ids[{i}] = {t!r} is not a non-negative int")


def check_structure(token_ids: Sequence[Any], features: Features, *, lax: bool = False) -> None:
    """Rules ``modality-keys``, ``item-count``, ``placeholder-range``, ``placeholder-overlap``.

    ``lax`` is vLLM's reading: ints coerced as its pydantic models do, and ``is_embed`` ignored
    (vLLM 0.33's ``PlaceholderRangeInfo`` has no such field; pydantic drops unknown keys).
    """
    modalities = set(features.mm_hashes)
    slots: list[tuple[str, Mapping[str, Any] | None]] = [
        ("mm_placeholders", features.mm_placeholders),
        ("kwargs_data", features.kwargs_data),
        ("mm_metadata", features.mm_metadata),
    ]
    for name, slot in slots:
        if slot is None:
            continue
        keys = set(slot)
        if keys != modalities:
            odd = sorted(keys ^ modalities)
            raise ValidationError(
                "modality-keys",
                f"{name} modalities {sorted(keys)} differ from mm_hashes {sorted(modalities)}",
                modality=odd[0] if odd else None,
                field=name,
            )
    for modality, hashes in features.mm_hashes.items():
        for name, slot in slots:
            if slot is not None and len(slot[modality]) != len(hashes):
                raise ValidationError(
                    "item-count",
                    f"{name} has {len(slot[modality])} items, mm_hashes has {len(hashes)}",
                    modality=modality,
                    field=name,
                )
    n = len(token_ids)
    ranges: list[tuple[int, int, str, int]] = []
    for modality, places in features.mm_placeholders.items():
        for i, p in enumerate(places):
            offset, length = _as_int(p.offset, lax), _as_int(p.length, lax)
            if offset is None or offset < 0:
                raise ValidationError(
                    "placeholder-range",
                    f"offset {p.offset!r} must be an int >= 0",
                    modality=modality,
                    item=i,
                )
            if length is None or length <= 0:
                raise ValidationError(
                    "placeholder-range",
                    f"length {p.length!r} must be an int > 0",
                    modality=modality,
                    item=i,
                )
            if (
                not lax
                and p.is_embed is not None
                and (
                    not isinstance(p.is_embed, list)
                    or len(p.is_embed) != p.length
                    or not all(isinstance(b, bool) for b in p.is_embed)
                )
            ):
                raise ValidationError(
                    "placeholder-range",
                    f"is_embed must be {p.length} booleans",
                    modality=modality,
                    item=i,
                    field="is_embed",
                )
            if offset + length > n:
                raise ValidationError(
                    "placeholder-range",
                    f"range [{offset}, {offset + length}) ends past token_ids (length {n})",
                    modality=modality,
                    item=i,
                )
            ranges.append((offset, offset + length, modality, i))
    ranges.sort()
    for (_, end, m0, i0), (start, _, m1, i1) in itertools.pairwise(ranges):
        if start < end:
            raise ValidationError(
                "placeholder-overlap",
                f"range starting at {start} overlaps {m0}[{i0}] which ends at {end}",
                modality=m1,
                item=i1,
            )


# ---------------------------------------------------------------------------------------------
# Tensors and metadata


def check_tensor(
    v: Any, config: ValidationConfig, *, modality: str | None, item: int | None, name: str
) -> None:
    """Rules ``tensor`` and ``tensor-nonfinite`` for one value (tensor or claim check)."""
    where: dict[str, Any] = {"modality": modality, "item": item, "field": name}
    if isinstance(v, TensorRef):
        if v.dtype not in DTYPE_SIZES:
            raise ValidationError("tensor", f"unknown dtype {v.dtype!r}", **where)
        if any(not is_int(d) or d < 0 for d in v.shape):
            raise ValidationError("tensor", f"invalid shape {v.shape!r}", **where)
        expected = math.prod(v.shape) * DTYPE_SIZES[v.dtype]
        if v.nbytes != expected:
            raise ValidationError(
                "tensor",
                f"claim check nbytes {v.nbytes} != {expected} for {v.dtype}{v.shape}",
                **where,
            )
        nbytes = v.nbytes
    elif tensor_ops.is_tensor(v):
        nbytes = tensor_ops.nbytes(v)
    else:
        raise ValidationError("tensor", f"expected a tensor, got {type(v).__name__}", **where)
    dtype = v.dtype if isinstance(v, TensorRef) else tensor_ops.dtype_name(v)
    if dtype not in config.allowed_dtypes:
        raise ValidationError("tensor", f"dtype {dtype} is not allowed", **where)
    if nbytes > config.max_tensor_bytes:
        raise ValidationError(
            "tensor", f"{nbytes} bytes exceed the limit of {config.max_tensor_bytes}", **where
        )
    if config.check_values and not isinstance(v, TensorRef) and v.is_floating_point() and v.numel():
        if not all_finite(v):
            raise ValidationError("tensor-nonfinite", "tensor holds NaN or Inf", **where)


all_finite = tensor_ops.all_finite
"""Re-exported: callers of the gate check a tensor's values with it."""


def grid_patches(
    grid: Any, config: ValidationConfig, *, modality: str, item: int | None, name: str
) -> tuple[int, int]:
    """(patch rows ``sum t*h*w``, embedding count ``/ merge**2``) of a ``*_grid_thw`` tensor."""
    where: dict[str, Any] = {"modality": modality, "item": item, "field": name}
    if not tensor_ops.is_tensor(grid):
        raise ValidationError(
            "grid-consistency", "the grid must travel inline, not as a claim check", **where
        )
    if (
        grid.is_floating_point()
        or tensor_ops.dtype_name(grid) == "bool"
        or grid.numel() == 0
        or grid.numel() % 3
    ):
        raise ValidationError(
            "grid-consistency",
            "grid must be a non-empty integer (t, h, w) tensor, "
            f"got {tensor_ops.dtype_label(grid)}{list(grid.shape)}",
            **where,
        )
    rows = tensor_ops.int_rows(grid, 3)
    m = config.merge_size
    patches = 0
    for t, h, w in rows:
        if t <= 0 or h <= 0 or w <= 0:
            raise ValidationError("grid-consistency", f"grid {[t, h, w]} must be positive", **where)
        if h % m or w % m:
            raise ValidationError(
                "grid-consistency",
                f"grid {[t, h, w]}: h and w must be multiples of merge size {m}",
                **where,
            )
        patches += t * h * w
    return patches, patches // (m * m)


def carries_encoder_inputs(modality: str, data: ItemData | None) -> bool:
    """Whether a ``kwargs_data`` slot is full data: it holds the model's encoder inputs
    (``pixel_values`` for images...). A slot with only the grid is metadata, not full data:
    nothing could compute the item's embedding from it. For a modality without a known
    encoder input, any field that is not a metadata field counts."""
    if not data:
        return False
    name = MAIN_ENCODER_INPUT.get(modality)
    if name is not None:
        return name in data
    return any(k not in DEFAULT_METADATA_FIELDS for k in data)


def _values(v: Any) -> list[Any] | None:
    return tensor_ops.flat_values(v) if tensor_ops.is_tensor(v) else None


def check_agreement(modality: str, item: int, full: ItemData | None, meta: ItemData | None) -> None:
    """A field in both ``kwargs_data`` and ``mm_metadata`` must hold the same values: the
    encoder would read one grid and M-RoPE the other (same token count, wrong positions)."""

    def where(name: str) -> dict[str, Any]:
        return {"modality": modality, "item": item, "field": name}

    for name in sorted(set(full or {}) & set(meta or {})):
        a, b = _values(full[name]), _values(meta[name])  # type: ignore[index]
        rule = "grid-consistency" if name in GRID_FIELDS.values() else "metadata-consistency"
        if a is None or b is None:
            if rule == "grid-consistency":  # both grids must be here to be compared
                raise ValidationError(
                    rule, "the grid must travel inline, not as a claim check", **where(name)
                )
            continue  # a claim-checked metadata field: its bytes are not here
        if a != b:
            raise ValidationError(
                rule,
                f"kwargs_data has {name}={short_repr(a)}, mm_metadata has {short_repr(b)}",
                **where(name),
            )


def _embed_count(p: Any) -> int:
    return sum(1 for b in p.is_embed if b) if p.is_embed is not None else int(p.length)


def check_item_data(
    modality: str,
    item: int,
    full: ItemData | None,
    meta: ItemData | None,
    placeholder: Any,
    config: ValidationConfig,
) -> None:
    """Strict per-item rules: tensors, metadata fields, required fields, grid consistency."""
    for src in (full, meta):
        for name, v in (src or {}).items():
            check_tensor(v, config, modality=modality, item=item, name=name)
    for name in meta or {}:
        if name not in config.metadata_fields:
            raise ValidationError(
                "metadata-field",
                f"{name!r} is not a metadata field; heavy inputs never travel in mm_metadata",
                modality=modality,
                item=item,
                field=name,
            )
    if full is None and meta is None:
        return
    check_agreement(modality, item, full, meta)
    merged: dict[str, Any] = {**(full or {}), **(meta or {})}
    for name in config.required_metadata.get(modality, ()):
        if name not in merged:
            raise ValidationError(
                "metadata-missing", f"item lacks {name!r}", modality=modality, item=item, field=name
            )
    grid_name = GRID_FIELDS.get(modality)
    if grid_name is None or grid_name not in merged:
        return
    patches, embeds = grid_patches(
        merged[grid_name], config, modality=modality, item=item, name=grid_name
    )
    if placeholder is not None and _embed_count(placeholder) != embeds:
        raise ValidationError(
            "grid-consistency",
            f"placeholder holds {_embed_count(placeholder)} embedding tokens, grid implies "
            f"{embeds} (t*h*w={patches} / merge {config.merge_size}^2)",
            modality=modality,
            item=item,
            field=grid_name,
        )
    pv_name = MAIN_ENCODER_INPUT.get(modality)
    if full is not None and pv_name is not None and pv_name in full:
        _check_rows(full[pv_name], patches, modality=modality, item=item, name=pv_name)


def _check_rows(
    pv: TensorLike, patches: int, *, modality: str, item: int | None, name: str
) -> None:
    shape = list(pv.shape)
    if not shape or shape[0] != patches:
        raise ValidationError(
            "grid-consistency",
            f"{name} has shape {shape}, grid implies {patches} rows",
            modality=modality,
            item=item,
            field=name,
        )


# ---------------------------------------------------------------------------------------------
# Entry points


def _slot(
    slots: Mapping[str, list[ItemData | None]] | None, modality: str, i: int
) -> ItemData | None:
    return None if slots is None else slots[modality][i]


def validate_features(
    token_ids: Sequence[int],
    features: Features | None,
    ec_transfer_params: Mapping[str, Any] | None,
    config: ValidationConfig,
    *,
    request_id: str | None = None,
) -> None:
    """Check one request's tokens and features; raise ``ValidationError`` on the first break.

    ``ec_transfer_params`` may be a ``dict[str, ECTransfer]`` (PrefillEvent) or a raw vLLM dict
    in either connector shape.
    """
    strict = config.mode == "strict"
    check_token_ids(token_ids, lax=not strict)
    if features is None:
        return
    check_structure(token_ids, features, lax=not strict)
    for modality, hashes in features.mm_hashes.items():
        for i, mm_hash in enumerate(hashes):
            full = _slot(features.kwargs_data, modality, i)
            meta = _slot(features.mm_metadata, modality, i)
            if not strict:
                if full is None and meta is not None and not ec_transfer_params:
                    raise ValidationError(
                        "ec-transfer-required",
                        "metadata-only multimodal items require ec_transfer_params",
                        modality=modality,
                        item=i,
                    )
                continue
            entry = find_ec_entry(ec_transfer_params, mm_hash)
            if entry is None:
                check_item_source(modality, i, mm_hash, full, meta)
            if entry is not None:
                check_ec_entry(
                    entry, mm_hash, config, modality=modality, item=i, request_id=request_id
                )
            check_item_data(modality, i, full, meta, features.mm_placeholders[modality][i], config)


def check_item_source(
    modality: str, item: int, mm_hash: str, full: ItemData | None, meta: ItemData | None
) -> None:
    """Rule ``ec-transfer-required`` for an item without an entry: it must carry its encoder
    inputs, or nothing could produce its embedding (a prefill would wait for it in vain)."""
    if carries_encoder_inputs(modality, full):
        return
    if full is not None:
        what = f"kwargs_data without encoder inputs (only {sorted(full)})"
    elif meta is not None:
        what = "metadata-only item"
    else:
        what = "item with neither data nor metadata"
    raise ValidationError(
        "ec-transfer-required",
        f"{what} needs an ec_transfer_params entry for mm_hash {mm_hash!r}",
        modality=modality,
        item=item,
    )


def validate_render_slots(features: Features) -> None:
    """Rule ``slots-across-modalities``: any metadata means full-length lists for every modality."""
    md = features.mm_metadata
    if md is None:
        return
    if not any(x is not None for items in md.values() for x in items):
        return
    for modality, hashes in features.mm_hashes.items():
        items = md.get(modality)
        if items is None or len(items) != len(hashes):
            raise ValidationError(
                "slots-across-modalities",
                f"mm_metadata needs a {len(hashes)}-item list for {modality!r} (None where an item "
                "has no metadata) because another item has metadata",
                modality=modality,
                field="mm_metadata",
            )


def validate_render_event(ev: RenderEvent, config: ValidationConfig | None = None) -> None:
    """A render event: slots across modalities, structure, and full data for every item."""
    config = config or ValidationConfig()
    validate_render_slots(ev.features)
    check_token_ids(ev.token_ids)
    check_structure(ev.token_ids, ev.features)
    f = ev.features
    for modality, hashes in f.mm_hashes.items():
        for i in range(len(hashes)):
            full = _slot(f.kwargs_data, modality, i)
            if not carries_encoder_inputs(modality, full):
                raise ValidationError(
                    "render-data-missing",
                    "render events carry full kwargs_data (the encoder inputs) for every item",
                    modality=modality,
                    item=i,
                )
            meta = _slot(f.mm_metadata, modality, i)
            check_item_data(modality, i, full, meta, f.mm_placeholders[modality][i], config)


def validate_prefill_expiry(ev: PrefillEvent, config: ValidationConfig) -> None:
    """Rule ``ec-expired`` alone, for an event that passed :func:`validate_prefill_event` with
    ``now_ms=None``: a worker checks everything else before it knows whether the expiry matters
    (a redelivery of a finished request, a passed deadline) and this once it does."""
    if config.now_ms is None:
        return
    now = config.now_ms()
    # Items first, so an expired entry is named by its modality and index; then every entry, as
    # the full validation checks them all.
    for modality, index, mm_hash in ev.features.items():
        entry = find_ec_entry(ev.ec_transfer_params, mm_hash)
        if entry is not None:
            check_ec_expiry(entry, mm_hash, now, modality=modality, item=index)
    for mm_hash, entry in ev.ec_transfer_params.items():
        check_ec_expiry(entry, mm_hash, now, modality=None, item=None)


def validate_prefill_event(ev: PrefillEvent, config: ValidationConfig) -> None:
    """A prefill event: every rule, and every ``ec_transfer_params`` entry checked.

    Strict mode adds what a prefill worker relies on: it never encodes, so every item needs an
    entry (full ``kwargs_data`` does not excuse it), and it computes M-RoPE positions from
    ``mm_metadata``, so every item's required metadata must be there.
    """
    validate_features(
        ev.token_ids, ev.features, ev.ec_transfer_params, config, request_id=ev.request_id
    )
    if config.mode != "strict":
        return
    meta = ev.features.mm_metadata or {}
    for modality, hashes in ev.features.mm_hashes.items():
        for i, mm_hash in enumerate(hashes):
            if find_ec_entry(ev.ec_transfer_params, mm_hash) is None:
                raise ValidationError(
                    "ec-transfer-required",
                    f"prefill needs an ec_transfer_params entry for mm_hash {mm_hash!r}; "
                    "it never runs the encoder",
                    modality=modality,
                    item=i,
                )
            item_meta = meta.get(modality, [None] * len(hashes))[i] or {}
            for name in config.required_metadata.get(modality, ()):
                if name not in item_meta:
                    raise ValidationError(
                        "metadata-missing",
                        f"prefill computes positions from mm_metadata, which lacks {name!r}",
                        modality=modality,
                        item=i,
                        field=name,
                    )
    for h, entry in ev.ec_transfer_params.items():
        check_ec_entry(entry, h, config, modality=None, item=None, request_id=ev.request_id)
    check_kv_transfer_params(ev.kv_transfer_params)


def validate_decode_event(
    ev: DecodeEvent, config: ValidationConfig, shape: KVShape | None = None
) -> None:
    """A decode event: its prefill event by every prefill rule (without the entries' expiry:
    it matters only if the prefill has to run again), its passed-through params, and its KV
    entry (``shape``: the worker's model; :mod:`schemas.kv_entries`)."""
    validate_prefill_event(ev.prefill, dataclasses.replace(config, now_ms=None))
    check_kv_transfer_params(ev.kv_transfer_params)
    if ev.kv is not None:
        check_kv_entry(ev.kv, ev.request_id, len(ev.prefill.token_ids), config, shape)


def validate_encode_event(ev: EncodeEvent, config: ValidationConfig) -> None:
    """An encode event: encoder inputs + grid present and consistent, tensors, EC entry."""
    where: dict[str, Any] = {"modality": ev.modality, "item": ev.item_index}
    if not is_int(ev.item_index) or ev.item_index < 0:
        raise ValidationError(
            "encode-inputs", f"item_index {ev.item_index!r} must be >= 0", **where
        )
    for name, v in ev.data.items():
        check_tensor(v, config, modality=ev.modality, item=ev.item_index, name=name)
    pv_name = MAIN_ENCODER_INPUT.get(ev.modality)
    grid_name = GRID_FIELDS.get(ev.modality)
    if pv_name is not None and pv_name not in ev.data:
        raise ValidationError(
            "encode-inputs", f"encode event lacks {pv_name!r}", field=pv_name, **where
        )
    for name in config.required_metadata.get(ev.modality, ()):
        if name not in ev.data:
            raise ValidationError(
                "metadata-missing", f"encode event lacks {name!r}", field=name, **where
            )
    if pv_name is not None and grid_name is not None and grid_name in ev.data:
        patches, _ = grid_patches(
            ev.data[grid_name], config, modality=ev.modality, item=ev.item_index, name=grid_name
        )
        _check_rows(
            ev.data[pv_name], patches, modality=ev.modality, item=ev.item_index, name=pv_name
        )
    check_ec_entry(
        ev.ec_transfer,
        ev.mm_hash,
        config,
        modality=ev.modality,
        item=ev.item_index,
        request_id=ev.request_id,
    )
