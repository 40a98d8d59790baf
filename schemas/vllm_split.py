"""``epd vllm split``: a vLLM render response -> encode requests + one prefill request.

A fan-out policy over vLLM's JSON (the codec is :mod:`schemas.vllm_wire`, vLLM's acceptance
:mod:`schemas.vllm_rules`). The decision is per item: an item travels metadata-only to
prefill only when its own ``ec_transfer_params`` entry can bring its embedding; see
:func:`split_render`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from schemas import defaults
from schemas.ec_entries import ec_entry_json, entry_locates_embedding, find_ec_entry
from schemas.errors import ValidationError
from schemas.keys import embedding_key
from schemas.signing import make_ec_transfer
from schemas.types import now_ms
from schemas.validator import DEFAULT_METADATA_FIELDS, carries_encoder_inputs, check_item_source
from schemas.vllm_rules import check_vllm_request
from schemas.vllm_wire import (
    KNOWN_FEATURE_KEYS,
    GenerateRequest,
    decode_item,
    encode_item,
    parse_generate_request,
    request_shape_error,
)


def _ec_entry_dict(
    mm_hash: str, store: str, key: str, expires_ms: int, secret: bytes | None
) -> dict[str, Any]:
    ec = make_ec_transfer(
        mm_hash=mm_hash, store=store, key=key, expires_ms=expires_ms, secret=secret
    )
    return ec_entry_json(ec)


def _ec_for_item(params: Mapping[str, Any], mm_hash: str) -> dict[str, Any]:
    """This item's own entry, in the shape ``params`` gives it (never another item's)."""
    items = params.get("ec_items")
    if isinstance(items, list):
        mine = [e for e in items if isinstance(e, Mapping) and e.get("mm_hash") == mm_hash]
        return {**{k: v for k, v in params.items() if k != "ec_items"}, "ec_items": mine}
    return {mm_hash: copy.deepcopy(params[mm_hash])}


def recover_metadata(b64: str, *, modality: str, item: int) -> str | None:
    """An ``mm_metadata`` item cut from a full ``kwargs_data`` item (renders from before
    ``mm_metadata`` existed): the fields vLLM's renderer would keep, metadata fields and
    ``keep_on_cpu`` ones, with their field specs. None when there are none."""
    tensors, specs = decode_item(b64, modality=modality, item=item)
    keep = {
        k: v for k, v in tensors.items() if k in DEFAULT_METADATA_FIELDS or specs[k].keep_on_cpu
    }
    return encode_item(keep, {k: specs[k] for k in keep}) if keep else None


def _normalized_render(obj: Mapping[str, Any]) -> dict[str, Any]:
    """A shallow copy whose ``mm_metadata`` names every modality: vLLM 0.33's renderer leaves
    modalities without metadata out, which its own generate endpoint would refuse."""
    feats = obj.get("features")
    out = dict(obj)
    if isinstance(feats, Mapping) and isinstance(feats.get("mm_metadata"), Mapping):
        md = dict(feats["mm_metadata"])
        for modality, hs in (feats.get("mm_hashes") or {}).items():
            if isinstance(hs, list):
                md.setdefault(modality, [None] * len(hs))
        out["features"] = {**feats, "mm_metadata": md}
    return out


@dataclass(slots=True)
class _Plan:
    """Where each item of a render goes: encode requests and the prefill's two slots."""

    encode: list[tuple[str, int]] = field(default_factory=list)
    kwargs: dict[str, list[str | None]] = field(default_factory=dict)
    meta: dict[str, list[str | None]] = field(default_factory=dict)


def _plan_split(
    req: GenerateRequest, feats: Mapping[str, Any], ec_params: Mapping[str, Any]
) -> _Plan:
    """Decide per item. An item goes metadata-only to prefill (and gets one encode request per
    distinct ``mm_hash``) only when it has its own usable entry and metadata (given, or
    recovered from its data); an item with encoder inputs but no entry keeps them; an item
    with neither inputs nor entry cannot get its embedding and the split is refused."""
    assert req.features is not None
    plan = _Plan()
    kwargs_raw: Mapping[str, list[str | None]] = feats.get("kwargs_data") or {}
    meta_raw: Mapping[str, list[str | None]] = feats.get("mm_metadata") or {}
    encoded: set[str] = set()
    for modality, hashes in req.features.mm_hashes.items():
        kw = kwargs_raw.get(modality) or [None] * len(hashes)
        md = meta_raw.get(modality) or [None] * len(hashes)
        plan.kwargs[modality], plan.meta[modality] = [], []
        for i, h in enumerate(hashes):
            full = (req.features.kwargs_data or {}).get(modality, [None] * len(hashes))[i]
            inputs = carries_encoder_inputs(modality, full)
            entry = find_ec_entry(ec_params, h)
            usable = entry is not None and entry_locates_embedding(entry)
            raw, meta = kw[i], md[i]
            if usable and meta is None and raw is not None:
                meta = recover_metadata(raw, modality=modality, item=i)
            if usable and meta is not None:
                if inputs and h not in encoded:
                    encoded.add(h)
                    plan.encode.append((modality, i))
                plan.kwargs[modality].append(None)
            elif inputs or (raw is None and meta is None):
                # Keeps its encoder inputs (prefill encodes it), or has neither: a
                # processor-cache hit, which vLLM resolves itself.
                plan.kwargs[modality].append(raw)
            else:
                why = (
                    f"no usable ec_transfer_params entry for mm_hash {h!r}"
                    if not usable
                    else "no metadata, given or recoverable from its data"
                )
                raise ValidationError(
                    "ec-transfer-required",
                    f"item without encoder inputs and with {why}: nothing could produce its "
                    "embedding",
                    modality=modality,
                    item=i,
                )
            plan.meta[modality].append(meta)
    return plan


def _check_split_output(encode: list[dict[str, Any]], prefill: dict[str, Any]) -> None:
    """vLLM must accept every request, and every prefill item must be able to get its
    embedding from its own ``kwargs_data`` or from its own entry of the prefill's params."""
    for body in [*encode, prefill]:
        check_vllm_request(body)
    req = parse_generate_request(prefill)
    assert req.features is not None
    f = req.features
    for modality, hashes in f.mm_hashes.items():
        for i, h in enumerate(hashes):
            full = (f.kwargs_data or {}).get(modality, [None] * len(hashes))[i]
            meta = (f.mm_metadata or {}).get(modality, [None] * len(hashes))[i]
            entry = find_ec_entry(req.ec_transfer_params, h)
            if (entry is None or not entry_locates_embedding(entry)) and (
                full is not None or meta is not None
            ):
                check_item_source(modality, i, h, full, meta)


def split_render(
    obj: Mapping[str, Any],
    ec_transfer_params: Mapping[str, Any] | None = None,
    *,
    secret: bytes | None,
    namespace: str = defaults.EC_NAMESPACE,
    store: str = defaults.REDIS_URL,
    model_fingerprint: str = defaults.TINY_MODEL,
    ttl_s: int = defaults.EMBEDDING_TTL_S,
    now: int | None = None,
) -> dict[str, Any]:
    """Split a vLLM render response into encode requests and one prefill request.

    Per item (see :func:`_plan_split`): an item with its own ``ec_transfer_params`` entry and
    metadata (``mm_metadata``, or recovered from ``kwargs_data`` for older renders) travels
    metadata-only to prefill, and one encode request per distinct ``mm_hash`` carries its
    ``kwargs_data`` (that item alone, ``max_tokens: 1``, only its own entry). An item without
    an entry keeps its ``kwargs_data`` in the prefill request; one that has neither encoder
    inputs nor an entry is refused (rule ``ec-transfer-required``, modality and item named).
    ``mm_metadata`` gets a full-length list for every modality whenever any item has metadata.

    Without ``ec_transfer_params`` an entry per item is generated, keyed by ``mm_hash``, with
    key ``{namespace}:{model_fingerprint}:{mm_hash}`` and signed when ``secret`` is set. The
    render is checked against vLLM's rules first, and the output is checked again, with the
    params it will carry. Item strings are passed through byte for byte.
    """
    req = parse_generate_request(obj)  # our decoder: the shape and every item's encoding
    feats = obj.get("features")
    if req.features is None or not isinstance(feats, Mapping):
        raise request_shape_error("a render response needs features", fld="features")
    hashes = req.features.mm_hashes
    if ec_transfer_params is None:
        expires = (now if now is not None else now_ms()) + ttl_s * 1000
        ec_params: dict[str, Any] = {
            h: _ec_entry_dict(
                h, store, embedding_key(namespace, model_fingerprint, h), expires, secret
            )
            for hs in hashes.values()
            for h in hs
        }
    else:
        ec_params = copy.deepcopy(dict(ec_transfer_params))
    # vLLM's rules on the render as it will be sent on: with the params the requests carry.
    check_vllm_request({**_normalized_render(obj), "ec_transfer_params": ec_params})
    plan = _plan_split(req, feats, ec_params)

    base = {k: copy.deepcopy(v) for k, v in obj.items() if k not in ("features",)}
    base.pop("ec_transfer_params", None)
    rid = obj.get("request_id") or "request"
    encode: list[dict[str, Any]] = []
    for modality, i in plan.encode:
        h = hashes[modality][i]
        meta = (feats.get("mm_metadata") or {}).get(modality)
        enc_req = copy.deepcopy(base)
        enc_req.pop("kv_transfer_params", None)
        enc_req["request_id"] = f"{rid}-encode-{modality}-{i}"
        enc_req["features"] = {
            "mm_hashes": {modality: [h]},
            "mm_placeholders": {modality: [copy.deepcopy(feats["mm_placeholders"][modality][i])]},
            "kwargs_data": {modality: [feats["kwargs_data"][modality][i]]},
            "mm_metadata": None if not meta or meta[i] is None else {modality: [meta[i]]},
        }
        enc_req["sampling_params"] = {**(enc_req.get("sampling_params") or {}), "max_tokens": 1}
        enc_req["ec_transfer_params"] = _ec_for_item(ec_params, h)
        encode.append(enc_req)

    def any_item(slots: dict[str, list[str | None]]) -> bool:
        return any(x is not None for items in slots.values() for x in items)

    prefill = copy.deepcopy(base)
    prefill["features"] = {
        **{k: copy.deepcopy(v) for k, v in feats.items() if k not in KNOWN_FEATURE_KEYS},
        "mm_hashes": copy.deepcopy(hashes),
        "mm_placeholders": copy.deepcopy(feats["mm_placeholders"]),
        "kwargs_data": plan.kwargs if any_item(plan.kwargs) else None,
        "mm_metadata": plan.meta if any_item(plan.meta) else None,
    }
    prefill["ec_transfer_params"] = ec_params
    _check_split_output(encode, prefill)
    return {"encode": encode, "prefill": prefill}
