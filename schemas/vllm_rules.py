"""vLLM's own acceptance of a ``/inference/v1/generate`` body: the ``vllm`` validation mode.

Written from vLLM 0.33.0's ``entrypoints/scale_out/token_in_token_out/`` (``protocol.py``:
``GenerateRequest``, ``MultiModalFeatures``, ``PlaceholderRangeInfo``; ``serving.py``:
``serve_tokens``; ``mm_features.py`` + ``mm_serde.py``: how items are decoded) and
``v1/serial_utils.py`` (``MsgpackDecoder``). No vLLM code is imported or copied: the types are
declared again as our own pydantic models, so the same library applies the same lax coercion
(``1.0``, ``true`` and ``"0"`` are ints there, as in vLLM), and the cross-field and decoding
rules are re-stated below with a note on the vLLM behaviour each one mirrors.

A request counts as rejected when vLLM answers it with an error before scheduling it: a
pydantic failure (400), a ``serve_tokens`` check, or an exception while it decodes the
features (``mm_kwargs_from_features``). Not mirrored, because they depend on the serving
configuration or on vLLM classes we do not re-declare: ``SamplingParams``' own field checks
(only its type, ``detokenize`` and ``extra_args`` are mirrored), ``parse_context``'s nested
tool types, ``n <= max_num_seqs``, the processor cache's ``validate_input_item``, and model
checks the engine makes later.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Literal

import msgpack
import pydantic
import torch
from pydantic import BaseModel, ConfigDict, Field

from schemas.errors import ValidationError
from schemas.types import Features, PlaceholderRange
from schemas.validator import ValidationConfig, validate_features

# msgspec (vLLM's encoder) packs ints as int64 or uint64 and raises OverflowError otherwise
# (``serve_tokens`` encodes sampling_params, kv_transfer_params, ec_transfer_params up front).
_MSGPACK_INT_RANGE = (-(2**63), 2**64 - 1)
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")  # validate_cache_salt in generate/base/protocol.py
_CACHE_SALT_MAX = 128
_PARSE_CONTEXT_FIELDS = frozenset(
    {
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "include_reasoning",
        "chat_template_kwargs",
        "history_tool_call_cnt",
    }
)


class _Placeholder(BaseModel):
    """``PlaceholderRangeInfo``: extra keys (``is_embed``) are ignored, as pydantic's default."""

    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class _Features(BaseModel):
    """``MultiModalFeatures`` field types (its cross-field validator is re-stated elsewhere)."""

    mm_hashes: dict[str, list[str]]
    mm_placeholders: dict[str, list[_Placeholder]]
    kwargs_data: dict[str, list[str | None]] | None = None
    mm_metadata: dict[str, list[str | None]] | None = None


class _SamplingParams(BaseModel):
    """The part of ``SamplingParams`` mirrored here: it must be an object; ``detokenize`` is
    read by the output-mode check, ``extra_args`` is where serving puts EC params."""

    detokenize: bool = True
    extra_args: dict[str, Any] | None = None


class _StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _ReasoningParserKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)


class _Request(BaseModel):
    """``GenerateRequest`` field types and constraints."""

    request_id: str = ""
    token_ids: list[int] = Field(min_length=1)
    token_offsets: list[tuple[int, int]] | None = None
    features: _Features | None = None
    content_parts: list[dict[str, Any]] | None = None
    sampling_params: _SamplingParams
    model: str | None = None
    reasoning_ended: bool | None = None
    reasoning_parser_kwargs: _ReasoningParserKwargs | None = None
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    parse_context: dict[str, Any] | None = None
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=1024)
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


def _shape(msg: str, **where: Any) -> ValidationError:
    return ValidationError("request-shape", msg, **where)


def _from_pydantic(err: pydantic.ValidationError) -> ValidationError:
    """Our rule for vLLM's first pydantic complaint (any complaint is a 400 there)."""
    first = err.errors()[0]
    loc = tuple(first["loc"])
    msg = f"{'.'.join(str(p) for p in loc) or 'body'}: {first['msg']}"
    if loc[:1] == ("token_ids",):
        return ValidationError("token-ids", msg, field="token_ids")
    if loc[:2] == ("features", "mm_placeholders") and len(loc) >= 4:
        modality, item = str(loc[2]), loc[3] if isinstance(loc[3], int) else None
        return ValidationError(
            "placeholder-range", msg, modality=modality, item=item, field=str(loc[-1])
        )
    return _shape(msg, field=str(loc[0]) if loc else None)


def _check_cache_salt(obj: Mapping[str, Any]) -> None:
    """``validate_cache_salt`` runs on the raw body before the field types."""
    salt = obj.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise _shape("cache_salt must be a non-empty string", field="cache_salt")
    if len(salt) > _CACHE_SALT_MAX or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise _shape(
            "cache_salt must be at most 128 characters without '@', '/', '\\' or NUL",
            field="cache_salt",
        )


def _check_packable(value: Any, name: str) -> None:
    """``serve_tokens`` msgpack-encodes the transfer params first (msgspec); what it cannot
    encode fails there: an int outside int64/uint64, a string (value or key) that is not valid
    UTF-8 (JSON can carry a lone surrogate ``"\\ud800"``). Iterative, so a deeply nested value
    cannot exhaust the stack here."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, bool):
            continue
        if isinstance(v, int) and not _MSGPACK_INT_RANGE[0] <= v <= _MSGPACK_INT_RANGE[1]:
            raise _shape(f"{name} holds an integer msgpack cannot encode", field=name)
        if isinstance(v, str) and not _utf8(v):
            raise _shape(f"{name} holds a string that is not valid UTF-8", field=name)
        if isinstance(v, Mapping):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _skeleton(f: _Features) -> Features:
    """Our Features with a placeholder ``{}`` for each present item, for the structure rules."""

    def slots(s: dict[str, list[str | None]] | None) -> dict[str, list[Any]] | None:
        if s is None:
            return None
        return {m: [None if x is None else {} for x in v] for m, v in s.items()}

    return Features(
        mm_hashes=f.mm_hashes,
        mm_placeholders={
            m: [PlaceholderRange(p.offset, p.length) for p in v]
            for m, v in f.mm_placeholders.items()
        },
        kwargs_data=slots(f.kwargs_data),
        mm_metadata=slots(f.mm_metadata),
    )


def check_vllm_request(obj: Any) -> None:
    """Raise ``ValidationError`` exactly when vLLM 0.33's ``/inference/v1/generate`` would
    refuse ``obj`` (a parsed JSON body) before scheduling it; see the module docstring."""
    if isinstance(obj, Mapping):
        _check_cache_salt(obj)
    try:
        req = _Request.model_validate(obj)
    except pydantic.ValidationError as e:
        raise _from_pydantic(e) from None
    # model validators of GenerateRequest
    if req.content_parts and req.features is not None:
        raise _shape("content_parts and features are mutually exclusive", field="features")
    if req.output_mode != "tokens" and not req.sampling_params.detokenize:
        raise _shape(
            f"output_mode={req.output_mode!r} requires sampling_params.detokenize",
            field="output_mode",
        )
    if req.output_mode == "derender" and req.parse_context is not None:
        unknown = sorted(set(req.parse_context) - _PARSE_CONTEXT_FIELDS)
        if unknown:
            raise _shape(f"unknown parse_context fields {unknown}", field="parse_context")
    if req.features is not None:
        # MultiModalFeatures._validate_parallel_fields, GenerateRequest's bounds check and
        # _require_ec_for_metadata_only (top-level ec_transfer_params only, any non-empty
        # dict): the same rules validate_features applies in vllm mode.
        validate_features(
            req.token_ids,
            _skeleton(req.features),
            req.ec_transfer_params,
            ValidationConfig(mode="vllm"),
        )
    # serve_tokens: the transfer params must msgpack-encode, then features are decoded.
    _check_packable(req.kv_transfer_params, "kv_transfer_params")
    _check_packable(req.ec_transfer_params, "ec_transfer_params")
    if req.features is not None and not req.content_parts:
        for slot in (req.features.kwargs_data, req.features.mm_metadata):
            for modality, items in (slot or {}).items():
                for i, b64 in enumerate(items):
                    if b64 is not None:
                        vllm_decode_item(b64, modality=modality, item=i)


# ---------------------------------------------------------------------------------------------
# Decoding one item the way vLLM does (mm_serde.decode_mm_kwargs_item + MsgpackDecoder)


class _Raw(bytes):
    """Ext type 3 (``CUSTOM_TYPE_RAW_VIEW``): vLLM's ext_hook gives a memoryview of it."""


def _ext_hook(code: int, data: bytes) -> Any:
    # MsgpackDecoder.ext_hook: raw views pass; any other code is NotImplementedError (pickle
    # codes only with VLLM_ALLOW_INSECURE_SERIALIZATION, never on a public endpoint).
    if code == 3:
        return _Raw(data)
    raise ValueError(f"msgpack ext type {code} is not supported")


def _fail(msg: str, modality: str | None, item: int | None, fld: str | None = None) -> None:
    raise ValidationError("tensor", msg, modality=modality, item=item, field=fld)


def vllm_decode_item(b64: Any, *, modality: str | None = None, item: int | None = None) -> None:
    """Raise ``ValidationError(rule="tensor")`` where vLLM's decode of one item raises."""
    try:
        # pybase64.b64decode without validate: characters outside the alphabet are dropped,
        # padding is still checked.
        raw = base64.b64decode(b64)
    except (binascii.Error, ValueError, TypeError) as e:
        _fail(f"invalid base64: {e}", modality, item)
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=_ext_hook)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as e:
        _fail(f"invalid msgpack: {e}", modality, item)
    # _decode_mm_item calls obj.items(): the document must be a map.
    if not isinstance(doc, dict):
        _fail(f"item must be a msgpack map, got {type(doc).__name__}", modality, item)
    for name, elem in doc.items():
        try:
            _decode_elem(elem)
        except (ValueError, TypeError, RecursionError) as e:
            _fail(str(e), modality, item, str(name))


def _decode_elem(elem: Any) -> None:
    """``_decode_mm_field_elem``: ``{"data": ..., "field": [factory, {kwargs}]}`` exactly."""
    if not isinstance(elem, dict) or "data" not in elem or "field" not in elem:
        raise ValueError('each field must be a map with "data" and "field"')
    # MultiModalFieldElem(**obj): no other keys, all of them strings.
    if set(elem) != {"data", "field"}:
        raise TypeError(f"unexpected field element keys {sorted(map(str, elem))}")
    if elem["data"] is not None:  # None: an engine-cached element, accepted there
        _decode_nested(elem["data"])
    spec = elem["field"]
    # ``factory_meth_name, factory_kw = obj["field"]``: only a two-element array can name a
    # factory and give a kwargs map (a 2-char string or 2-key map unpacks, then fails).
    if not isinstance(spec, list) or len(spec) != 2:
        raise TypeError("field spec must be [factory, {kwargs}]")
    _check_factory(*spec)


# Keyword names of each MultiModalFieldConfig factory (after its positional ``modality``).
_FACTORY_KWARGS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "batched": (frozenset(), frozenset({"keep_on_cpu"})),
    "flat": (frozenset({"slices"}), frozenset({"slices", "dim", "keep_on_cpu"})),
    "flat_from_sizes": (
        frozenset({"size_per_item"}),
        frozenset({"size_per_item", "dim", "keep_on_cpu"}),
    ),
    "shared": (frozenset({"batch_size"}), frozenset({"batch_size", "keep_on_cpu"})),
}


def _check_factory(name: Any, kwargs: Any) -> None:
    if not isinstance(name, str) or name not in _FACTORY_KWARGS:
        raise ValueError(f"unknown field factory {name!r}")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"{name!r} field kwargs must be a map with string keys")
    required, allowed = _FACTORY_KWARGS[name]
    if missing := required - set(kwargs):
        raise TypeError(f"{name!r} field lacks {sorted(missing)}")
    if extra := set(kwargs) - allowed:
        raise TypeError(f"{name!r} field got unexpected {sorted(extra)}")
    if name == "flat":
        _decode_slices(kwargs["slices"])
    if name == "flat_from_sizes" and not isinstance(kwargs["size_per_item"], _Raw):
        # It reads ``size_per_item.ndim``: of what msgpack yields, only a raw view has one.
        raise TypeError("flat_from_sizes needs a tensor size_per_item")


def _decode_slices(obj: Any) -> None:
    """``_decode_nested_slices``: a list of 1-3 values is a slice, else a list of those."""
    stack = [obj]
    while stack:
        s = stack.pop()
        if not isinstance(s, list):
            raise TypeError("slices must be lists")
        if s and not isinstance(s[0], list):
            if len(s) > 3:
                raise TypeError(f"slice expected at most 3 values, got {len(s)}")
        else:
            stack.extend(s)


def _decode_nested(obj: Any) -> None:
    """``_decode_nested_tensors``: numbers pass, ``[dtype, shape, data]`` is a tensor, other
    lists hold more of the same; anything else is a TypeError."""
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, int | float):  # bool is an int there too
            continue
        if not isinstance(x, list):
            raise TypeError(f"unexpected tensor contents: {type(x).__name__}")
        if x and isinstance(x[0], str):
            _decode_tensor(x)
        else:
            stack.extend(x)


def _decode_tensor(arr: list[Any]) -> None:
    """``MsgpackDecoder._decode_tensor`` on an inline buffer, checked on the meta device (no
    allocation) with the same torch calls, so shapes and dtypes are judged by torch itself."""
    if len(arr) != 3:
        raise ValueError(f"tensor must be [dtype, shape, data], got {len(arr)} values")
    dtype_name, shape, data = arr
    if isinstance(data, dict):
        raise ValueError("out-of-band tensors are not accepted on this endpoint")
    if isinstance(data, int):  # an aux-buffer index; a JSON item has no aux buffers
        raise ValueError("tensor refers to an out-of-band buffer that JSON cannot carry")
    if not isinstance(data, bytes):
        raise TypeError(f"tensor bytes must be bin or ext 3, got {type(data).__name__}")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {dtype_name!r}")
    try:
        if not data:
            if 0 not in shape:  # an assert there
                raise ValueError("an empty buffer needs a 0 in its shape")
            torch.empty(shape, dtype=dtype, device="meta")
        else:
            torch.empty(len(data), dtype=torch.uint8, device="meta").view(dtype).view(shape)
    except (RuntimeError, TypeError, OverflowError) as e:
        raise ValueError(f"tensor {dtype_name}{shape!r} from {len(data)} bytes: {e}") from None
