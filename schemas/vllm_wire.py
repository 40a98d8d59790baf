"""vLLM scale-out JSON interop: ``GenerateRequest`` bodies and their base64/msgpack items.

vLLM's ``render`` endpoint returns a ``GenerateRequest`` (``vllm/entrypoints/serve/disagg/
protocol.py``): ``request_id``, ``token_ids``, ``features``, ``sampling_params``, ``model``,
``stream``, ``stream_options``, ``cache_salt``, ``priority``, ``kv_transfer_params`` (vLLM's P/D
connector parameters: modelled, never read, passed through unchanged) and, for encoder-cache
disaggregation, ``ec_transfer_params``. ``features`` is a ``MultiModalFeatures``:
``mm_hashes``, ``mm_placeholders`` (``offset``, ``length``, optional ``is_embed``),
``kwargs_data`` and ``mm_metadata`` (per modality, per item: base64 string or null). Fields we
do not model are kept verbatim and written back, so a round trip loses nothing.

One item (``kwargs_data`` / ``mm_metadata`` entry) is standard base64 of one msgpack document,
the shape vLLM 0.33's ``MsgpackEncoder`` gives a ``MultiModalKwargsItem``::

    {field_name: {"data": [dtype, shape, ExtType(3, raw little-endian bytes)],
                  "field": [factory_name, {field_name: value, ...}]}}

``dtype`` is torch's name without the ``torch.`` prefix; ext type 3 is vLLM's
``CUSTOM_TYPE_RAW_VIEW`` (inline raw bytes). ``factory_name`` is ``batched``, ``flat`` or
``shared`` (``MultiModalFieldConfig`` factories) and the map holds every field of the field
dataclass: ``keep_on_cpu``, plus ``slices`` and ``dim`` for ``flat`` or ``batch_size`` for
``shared`` (vLLM's decoder calls ``factory(modality, **map)``). Slices travel as
``[start, stop, step]``. Older vLLM wrote the values positionally,
``[factory_name, *field_values]``; the decoder still reads that, the writer does not (vLLM 0.33
fails to decode it).

This module has no vLLM dependency: the format is implemented from that description.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from schemas.errors import CodecError, ValidationError
from schemas.modalities import ENCODER_INPUT_FIELDS, METADATA_FIELDS
from schemas.tensors import DTYPE_NAMES, DTYPES, tensor_bytes, tensor_from_bytes
from schemas.types import Features, ItemData, PlaceholderRange
from schemas.validator import (
    ValidationConfig,
    validate_features,
)
from schemas.values import is_int
from schemas.vllm_rules import check_vllm_request

RAW_VIEW_EXT = 3
"""vLLM's ``CUSTOM_TYPE_RAW_VIEW`` msgpack extension code: inline raw tensor bytes."""

FACTORIES = ("batched", "flat", "shared")
# Field-value order of each factory's dataclass (base-class ``keep_on_cpu`` comes first).
_FACTORY_FIELDS: dict[str, tuple[str, ...]] = {
    "batched": ("keep_on_cpu",),
    "flat": ("keep_on_cpu", "slices", "dim"),
    "shared": ("keep_on_cpu", "batch_size"),
}

KNOWN_REQUEST_KEYS = (
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "cache_salt",
    "ec_transfer_params",
    "kv_transfer_params",
)
KNOWN_FEATURE_KEYS = ("mm_hashes", "mm_placeholders", "kwargs_data", "mm_metadata")


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """How vLLM batches one field: a ``MultiModalFieldConfig`` factory and its values."""

    factory: str = "batched"
    values: Mapping[str, Any] = field(default_factory=lambda: {"keep_on_cpu": False})

    @property
    def keep_on_cpu(self) -> bool:
        return bool(self.values.get("keep_on_cpu", False))

    def wire(self) -> list[Any]:
        """``[factory_name, {field_name: value}]``, every field of the field dataclass."""
        if self.factory not in _FACTORY_FIELDS:
            raise CodecError(f"unknown field factory {self.factory!r}; expected {FACTORIES}")
        defaults: dict[str, Any] = {"keep_on_cpu": False, "dim": 0, "batch_size": 1}
        values: dict[str, Any] = {}
        for name in _FACTORY_FIELDS[self.factory]:
            if name in self.values:
                values[name] = self.values[name]
            elif name in defaults:
                values[name] = defaults[name]
            else:
                raise CodecError(f"field factory {self.factory!r} needs a {name!r} value")
        return [self.factory, values]


def batched(*, keep_on_cpu: bool = False) -> FieldSpec:
    """``MultiModalFieldConfig.batched``: one element per item along dim 0."""
    return FieldSpec("batched", {"keep_on_cpu": keep_on_cpu})


def flat(rows: int, *, dim: int = 0, keep_on_cpu: bool = False) -> FieldSpec:
    """``MultiModalFieldConfig.flat`` for a single item holding ``rows`` rows along ``dim``."""
    sl: list[Any] = [0, rows, None]
    slices: list[Any] = [sl] if dim == 0 else [[*([[None, None, None]] * dim), sl]]
    return FieldSpec("flat", {"keep_on_cpu": keep_on_cpu, "slices": slices, "dim": dim})


# Qwen2-VL's field config in vLLM (``_create_qwen2vl_field_factory``): encoder inputs are
# ``flat_from_sizes`` (patch rows per item), grids are ``batched(keep_on_cpu=True)`` because
# M-RoPE reads them on the CPU. ``second_per_grid_ts`` (Qwen2.5-VL) is batched too.
_KEEP_ON_CPU_BATCHED = METADATA_FIELDS
# Precomputed embeddings (``image_embeds``) are flat per item too.
_FLAT = ENCODER_INPUT_FIELDS | {"image_embeds", "video_embeds"}


def default_field_spec(name: str, tensor: torch.Tensor) -> FieldSpec:
    """The spec vLLM gives field ``name`` of a Qwen2-VL-style item (``batched`` if unknown)."""
    if name in _KEEP_ON_CPU_BATCHED:
        return batched(keep_on_cpu=True)
    if name in _FLAT:
        return flat(int(tensor.shape[0]) if tensor.dim() > 0 else 1)
    return batched()


# ---------------------------------------------------------------------------------------------
# One item


def _tensor_wire(t: torch.Tensor) -> list[Any]:
    try:
        dtype = DTYPE_NAMES[t.dtype]
    except KeyError:
        raise CodecError(f"dtype {t.dtype} is not supported on the wire") from None
    return [dtype, list(t.shape), msgpack.ExtType(RAW_VIEW_EXT, tensor_bytes(t))]


def encode_item(
    item: Mapping[str, torch.Tensor], fields: Mapping[str, FieldSpec] | None = None
) -> str:
    """One ``MultiModalKwargsItem`` as vLLM's base64 msgpack string.

    ``fields`` overrides the per-field :class:`FieldSpec`; unnamed fields get
    :func:`default_field_spec`.
    """
    doc: dict[str, Any] = {}
    for name, t in item.items():
        if not isinstance(t, torch.Tensor):
            raise CodecError(f"field {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        spec = (fields or {}).get(name) or default_field_spec(name, t)
        doc[name] = {"data": _tensor_wire(t), "field": spec.wire()}
    packed = msgpack.packb(doc, use_bin_type=True)
    return base64.b64encode(packed).decode("ascii")


def _item_error(
    msg: str, modality: str | None, item: int | None, fld: str | None = None
) -> ValidationError:
    return ValidationError("tensor", msg, modality=modality, item=item, field=fld)


def _decode_tensor(obj: Any, where: tuple[str | None, int | None, str]) -> torch.Tensor:
    modality, item, name = where
    if isinstance(obj, bool):
        raise _item_error("field data is a bool, expected a tensor", modality, item, name)
    if isinstance(obj, int):
        # msgpack carries uint64 too; our tensors are int64 (vLLM keeps a Python int there).
        if not -(2**63) <= obj < 2**63:
            raise _item_error(f"scalar {obj} does not fit int64", modality, item, name)
        return torch.tensor(obj, dtype=torch.int64)
    if isinstance(obj, float):
        return torch.tensor(obj, dtype=torch.float64)
    if not (isinstance(obj, list) and len(obj) == 3 and isinstance(obj[0], str)):
        raise _item_error(
            "field data must be [dtype, shape, ExtType(3, bytes)] (nested tensor lists are not "
            "supported)",
            modality,
            item,
            name,
        )
    dtype, shape, data = obj
    if dtype not in DTYPES:
        raise _item_error(f"unknown dtype {dtype!r}", modality, item, name)
    if not isinstance(shape, list) or any(not is_int(d) or d < 0 for d in shape):
        raise _item_error(f"invalid shape {shape!r}", modality, item, name)
    if is_int(data):
        raise _item_error(
            "out-of-band tensor buffers are not supported on JSON", modality, item, name
        )
    if not isinstance(data, msgpack.ExtType):
        raise _item_error(
            f"tensor bytes must be a msgpack ext, got {type(data).__name__}", modality, item, name
        )
    if data.code != RAW_VIEW_EXT:
        raise _item_error(
            f"ext type {data.code}, expected {RAW_VIEW_EXT} (raw view)", modality, item, name
        )
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if expected != len(data.data):
        raise _item_error(
            f"size mismatch: dtype {dtype} shape {shape} needs {expected} bytes, got "
            f"{len(data.data)}",
            modality,
            item,
            name,
        )
    try:
        return tensor_from_bytes(dtype, shape, data.data)
    except (CodecError, RuntimeError, ValueError, OverflowError) as e:
        raise _item_error(str(e), modality, item, name) from None


def _decode_field_spec(obj: Any, where: tuple[str | None, int | None, str]) -> FieldSpec:
    modality, item, name = where
    if not isinstance(obj, list) or not obj or obj[0] not in FACTORIES:
        raise _item_error(
            f"field spec must be [factory, ...] with factory in {FACTORIES}", modality, item, name
        )
    factory, rest = obj[0], obj[1:]
    if len(rest) == 1 and isinstance(rest[0], dict):  # newer vLLM: [factory, {name: value}]
        return FieldSpec(factory, dict(rest[0]))
    names = _FACTORY_FIELDS[factory]
    if factory == "flat" and rest and isinstance(rest[0], list):
        names = ("slices", "dim", "keep_on_cpu")  # older vLLM: slices first, no keep_on_cpu
    if len(rest) > len(names):
        raise _item_error(
            f"{factory!r} field spec has {len(rest)} values, expected <= {len(names)}",
            modality,
            item,
            name,
        )
    return FieldSpec(factory, dict(zip(names, rest, strict=False)))


def decode_item(
    b64: str, *, modality: str | None = None, item: int | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, FieldSpec]]:
    """Tensors and field specs of one base64 msgpack item.

    Raises ``ValidationError(rule="tensor")`` naming ``modality``/``item``/field for bad base64,
    bad msgpack, a wrong ext type or a size mismatch.
    """
    if not isinstance(b64, str):
        raise _item_error(f"item must be a base64 string, got {type(b64).__name__}", modality, item)
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _item_error(f"invalid base64: {e}", modality, item) from None
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError, RecursionError) as e:
        raise _item_error(f"invalid msgpack: {e}", modality, item) from None
    if not isinstance(doc, dict):
        raise _item_error(f"item must be a msgpack map, got {type(doc).__name__}", modality, item)
    tensors: dict[str, torch.Tensor] = {}
    specs: dict[str, FieldSpec] = {}
    for name, elem in doc.items():
        where = (modality, item, str(name))
        if not isinstance(elem, dict) or "data" not in elem or "field" not in elem:
            raise _item_error('each field must be a map with "data" and "field"', *where)
        if elem["data"] is None:
            raise _item_error("field data is null (engine-cached elements cannot travel)", *where)
        tensors[name] = _decode_tensor(elem["data"], where)
        specs[name] = _decode_field_spec(elem["field"], where)
    return tensors, specs


# ---------------------------------------------------------------------------------------------
# Features and GenerateRequest


def request_shape_error(
    msg: str, *, modality: str | None = None, item: int | None = None, fld: str | None = None
) -> ValidationError:
    """A ``request-shape`` rejection: a body whose structure is not a ``GenerateRequest``."""
    return ValidationError("request-shape", msg, modality=modality, item=item, field=fld)


def _decode_slots(obj: Any, name: str) -> dict[str, list[ItemData | None]] | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise request_shape_error(f"{name} must be an object or null", fld=name)
    out: dict[str, list[ItemData | None]] = {}
    for modality, items in obj.items():
        if not isinstance(items, list):
            raise request_shape_error(
                f"{name}[{modality!r}] must be a list", modality=modality, fld=name
            )
        decoded: list[ItemData | None] = []
        for i, b64 in enumerate(items):
            if b64 is None:
                decoded.append(None)
                continue
            tensors, _ = decode_item(b64, modality=modality, item=i)
            decoded.append(dict(tensors))
        out[modality] = decoded
    return out


def features_from_json(obj: Mapping[str, Any]) -> Features:
    """A :class:`Features` from vLLM's ``MultiModalFeatures`` JSON (items decoded to tensors)."""
    if not isinstance(obj, Mapping):
        raise request_shape_error("features must be an object", fld="features")
    hashes = obj.get("mm_hashes")
    places = obj.get("mm_placeholders")
    if not isinstance(hashes, dict) or not all(
        isinstance(v, list) and all(isinstance(h, str) for h in v) for v in hashes.values()
    ):
        raise request_shape_error("mm_hashes must map modality -> list of strings", fld="mm_hashes")
    if not isinstance(places, dict):
        raise request_shape_error(
            "mm_placeholders must map modality -> list", fld="mm_placeholders"
        )
    placeholders: dict[str, list[PlaceholderRange]] = {}
    for modality, ranges in places.items():
        if not isinstance(ranges, list):
            raise request_shape_error(
                "mm_placeholders entry must be a list", modality=modality, fld="mm_placeholders"
            )
        parsed = []
        for i, p in enumerate(ranges):
            if not isinstance(p, dict) or "offset" not in p or "length" not in p:
                raise request_shape_error(
                    "placeholder must be {offset, length[, is_embed]}",
                    modality=modality,
                    item=i,
                    fld="mm_placeholders",
                )
            # Types are the validator's job (rule placeholder-range); keep values as given.
            parsed.append(PlaceholderRange(p["offset"], p["length"], p.get("is_embed")))
        placeholders[modality] = parsed
    return Features(
        mm_hashes={m: list(v) for m, v in hashes.items()},
        mm_placeholders=placeholders,
        kwargs_data=_decode_slots(obj.get("kwargs_data"), "kwargs_data"),
        mm_metadata=_decode_slots(obj.get("mm_metadata"), "mm_metadata"),
    )


def _encode_slots(
    slots: Mapping[str, list[ItemData | None]] | None, fields: Mapping[str, FieldSpec] | None
) -> dict[str, list[str | None]] | None:
    if slots is None:
        return None
    out: dict[str, list[str | None]] = {}
    for modality, items in slots.items():
        enc: list[str | None] = []
        for item in items:
            if item is None:
                enc.append(None)
                continue
            tensors: dict[str, torch.Tensor] = {}
            for k, v in item.items():
                if not isinstance(v, torch.Tensor):
                    raise CodecError(
                        f"{modality} field {k!r} is a {type(v).__name__}; resolve claim checks "
                        "before writing vLLM JSON"
                    )
                tensors[k] = v
            enc.append(encode_item(tensors, fields))
        out[modality] = enc
    return out


def features_to_json(
    features: Features, fields: Mapping[str, FieldSpec] | None = None
) -> dict[str, Any]:
    """vLLM ``MultiModalFeatures`` JSON for ``features`` (tensors must be inline)."""
    places: dict[str, list[dict[str, Any]]] = {}
    for modality, ranges in features.mm_placeholders.items():
        out = []
        for p in ranges:
            d: dict[str, Any] = {"offset": p.offset, "length": p.length}
            if p.is_embed is not None:  # vLLM omits is_embed when None
                d["is_embed"] = list(p.is_embed)
            out.append(d)
        places[modality] = out
    return {
        "mm_hashes": {m: list(h) for m, h in features.mm_hashes.items()},
        "mm_placeholders": places,
        "kwargs_data": _encode_slots(features.kwargs_data, fields),
        "mm_metadata": _encode_slots(features.mm_metadata, fields),
    }


@dataclass(slots=True)
class GenerateRequest:
    """A parsed vLLM ``GenerateRequest``; unknown fields ride along in ``extra``."""

    token_ids: list[int]
    features: Features | None
    sampling_params: dict[str, Any]
    request_id: str | None = None
    model: str | None = None
    cache_salt: str | None = None
    ec_transfer_params: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's P/D connector parameters (``do_remote_decode``, ``do_remote_prefill``,
    ``remote_engine_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``...): never
    read here, passed on unchanged (:func:`kv_transfer_params_text` for an event)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Top-level fields we do not model (``stream``, ``priority``...)."""
    features_extra: dict[str, Any] = field(default_factory=dict)
    """``features`` fields we do not model (``requires_kv``, ``kv_handoff``...)."""


def parse_generate_request(obj: Any) -> GenerateRequest:
    """Parse a ``GenerateRequest`` JSON object, decoding every item to tensors.

    ``ec_transfer_params`` is read from the top level, or else from
    ``sampling_params.extra_args.ec_transfer_params`` (where vLLM's engine request reads it).
    """
    if not isinstance(obj, Mapping):
        raise request_shape_error("a GenerateRequest must be a JSON object")
    token_ids = obj.get("token_ids")
    if not isinstance(token_ids, list):
        raise request_shape_error("token_ids must be a list", fld="token_ids")
    sampling = obj.get("sampling_params", {})
    if not isinstance(sampling, dict):
        raise request_shape_error("sampling_params must be an object", fld="sampling_params")
    ec = obj.get("ec_transfer_params")
    if ec is None and isinstance(sampling.get("extra_args"), dict):
        ec = sampling["extra_args"].get("ec_transfer_params")
    if ec is not None and not isinstance(ec, dict):
        raise request_shape_error("ec_transfer_params must be an object", fld="ec_transfer_params")
    kv = obj.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise request_shape_error("kv_transfer_params must be an object", fld="kv_transfer_params")
    feats_obj = obj.get("features")
    features = None if feats_obj is None else features_from_json(feats_obj)
    features_extra = (
        {k: copy.deepcopy(v) for k, v in feats_obj.items() if k not in KNOWN_FEATURE_KEYS}
        if isinstance(feats_obj, Mapping)
        else {}
    )
    return GenerateRequest(
        token_ids=list(token_ids),
        features=features,
        sampling_params=copy.deepcopy(sampling),
        request_id=obj.get("request_id"),
        model=obj.get("model"),
        cache_salt=obj.get("cache_salt"),
        ec_transfer_params=copy.deepcopy(ec),
        kv_transfer_params=copy.deepcopy(kv),
        extra={k: copy.deepcopy(v) for k, v in obj.items() if k not in KNOWN_REQUEST_KEYS},
        features_extra=features_extra,
    )


def validate_request_json(obj: Any, config: ValidationConfig) -> None:
    """The gate for a vLLM ``GenerateRequest`` body; raises ``ValidationError``.

    Both modes first apply vLLM's own acceptance (:func:`schemas.vllm_rules.check_vllm_request`),
    so ``strict`` never accepts what vLLM refuses; ``strict`` then decodes the items and applies
    this pipeline's rules. No input raises anything else: a body too deeply nested to walk is a
    ``request-shape`` rejection.
    """
    try:
        check_vllm_request(obj)
        if config.mode == "strict":
            req = parse_generate_request(obj)
            validate_features(req.token_ids, req.features, req.ec_transfer_params, config)
    except RecursionError:
        raise request_shape_error("the request is nested too deeply to check") from None


def generate_request_to_json(
    req: GenerateRequest, fields: Mapping[str, FieldSpec] | None = None
) -> dict[str, Any]:
    """vLLM ``GenerateRequest`` JSON for ``req`` (unknown fields written back as read)."""
    out: dict[str, Any] = {}
    if req.request_id is not None:
        out["request_id"] = req.request_id
    out["token_ids"] = list(req.token_ids)
    if req.features is not None:
        out["features"] = {**features_to_json(req.features, fields), **req.features_extra}
    out["sampling_params"] = copy.deepcopy(req.sampling_params)
    if req.model is not None:
        out["model"] = req.model
    if req.cache_salt is not None:
        out["cache_salt"] = req.cache_salt
    if req.ec_transfer_params is not None:
        out["ec_transfer_params"] = copy.deepcopy(req.ec_transfer_params)
    if req.kv_transfer_params is not None:
        out["kv_transfer_params"] = copy.deepcopy(req.kv_transfer_params)
    out.update(copy.deepcopy(req.extra))
    return out


def kv_transfer_params_text(req: GenerateRequest) -> str | None:
    """The request's ``kv_transfer_params`` as the JSON text a RenderEvent carries (None when
    it has none): fan-out, prefill and decode pass it on unchanged, and
    :func:`kv_transfer_params_from_text` gives the object back."""
    if req.kv_transfer_params is None:
        return None
    return json.dumps(req.kv_transfer_params, separators=(",", ":"), sort_keys=False)


def kv_transfer_params_from_text(text: str | None) -> dict[str, Any] | None:
    """The object :func:`kv_transfer_params_text` wrote."""
    return None if text is None else dict(json.loads(text))
