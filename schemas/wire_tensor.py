"""Tensors as the wire carries them, held without torch: a dtype name, a shape and the raw
little-endian C-order bytes, viewed through numpy when values are read.

The render router only checks, hashes, recasts and forwards encoder inputs; it never computes
with them. Decoding its events into :class:`WireTensor` (``schemas.codec.wire_codec``) keeps
torch (hundreds of MB resident) out of that process. Every other process decodes into torch
tensors as before (:mod:`schemas.tensors`); what both representations are asked for goes
through :mod:`schemas.tensor_ops`, so each rule has one home.

numpy has no bfloat16: a bfloat16 tensor's elements are read as their 16-bit patterns and
widened to float32 (exact) when values are needed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from schemas.errors import CodecError
from schemas.types import DTYPE_SIZES

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("epd-pipeline's tensor wire format assumes a little-endian host")

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
"""The wire's floating-point dtypes (torch's ``is_floating_point``)."""

# How numpy holds each wire dtype; bfloat16 as its bit patterns (numpy has no such type).
_NUMPY: dict[str, np.dtype[Any]] = {
    name: np.dtype(name if name != "bfloat16" else "uint16").newbyteorder("<")
    for name in DTYPE_SIZES
}
_BF16_NAN = np.uint16(0xFFFF)
"""What torch's contiguous CPU cast makes of every NaN (its vectorised kernel blends NaN lanes
with 0xFFFF; only its scalar path, for 0-d or strided tensors, gives 0x7FC0)."""


def nbytes_of(dtype: str, shape: list[int]) -> int:
    """Byte size a tensor of this dtype and shape must have; CodecError for an unknown dtype."""
    try:
        size = DTYPE_SIZES[dtype]
    except KeyError:
        raise CodecError(
            f"unknown dtype {dtype!r}; expected one of {sorted(DTYPE_SIZES)}"
        ) from None
    return math.prod(shape) * size


def check_layout(dtype: str, shape: list[int], nbytes: int) -> None:
    """CodecError unless ``nbytes`` bytes are a tensor of ``dtype`` and ``shape``."""
    nbytes_of(dtype, [])  # the dtype first: an unknown one is named as such
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise CodecError(f"invalid tensor shape {shape}: dimensions must be non-negative ints")
    expected = nbytes_of(dtype, shape)
    if expected != nbytes:
        raise CodecError(
            f"tensor size mismatch: dtype {dtype} shape {list(shape)} needs {expected} bytes, "
            f"got {nbytes}"
        )


@dataclass(frozen=True, slots=True, eq=False)
class WireTensor:
    """One tensor's wire form: ``dtype`` (a wire name), ``shape``, and ``data``, its raw bytes
    (a flat byte view, never copied on decode)."""

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @classmethod
    def from_bytes(cls, dtype: str, shape: list[int], data: bytes | memoryview) -> WireTensor:
        """A wire tensor over ``data`` (no copy); CodecError when the sizes disagree."""
        view = memoryview(data).cast("B")
        check_layout(dtype, list(shape), len(view))
        return cls(dtype, tuple(shape), view)

    @classmethod
    def from_array(cls, array: np.ndarray[Any, Any], dtype: str | None = None) -> WireTensor:
        """A wire tensor holding ``array``'s bytes (``dtype``: the wire name, when the array
        holds another type's bit patterns, as uint16 does for bfloat16)."""
        name = dtype or array.dtype.name
        flat = np.ascontiguousarray(array).reshape(-1)
        return cls.from_bytes(name, list(array.shape), flat.view(np.uint8).data)

    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def element_size(self) -> int:
        """Bytes of one element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the data."""
        return len(self.data)

    def is_floating_point(self) -> bool:
        """Whether the dtype is a floating-point one."""
        return self.dtype in FLOAT_DTYPES

    def array(self) -> np.ndarray[Any, Any]:
        """A read-only numpy view of the elements (bfloat16: their uint16 bit patterns)."""
        return np.frombuffer(self.data, dtype=_NUMPY[self.dtype]).reshape(self.shape)

    def values(self) -> np.ndarray[Any, Any]:
        """The elements as numpy numbers (bfloat16 widened to float32, which is exact)."""
        a = self.array()
        if self.dtype == "bfloat16":
            return (a.astype(np.uint32) << 16).view(np.float32)
        return a

    def cast(self, dtype: str) -> WireTensor:
        """This tensor in ``dtype``, rounded as torch's ``.to`` rounds (float32 to bfloat16:
        round to nearest even; the other casts are numpy's, which agree with torch's)."""
        if dtype == self.dtype:
            return self
        if dtype == "bfloat16":
            return WireTensor.from_array(bfloat16_bits(self.values().astype(np.float32)), dtype)
        if dtype not in _NUMPY or (self.dtype == "bfloat16" and dtype == "bool"):
            raise CodecError(f"cannot cast a {self.dtype} wire tensor to {dtype}")
        return WireTensor.from_array(self.values().astype(_NUMPY[dtype]), dtype)


def bfloat16_bits(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """The bfloat16 bit patterns (uint16) of float32 ``x``, bit for bit what torch's contiguous
    CPU ``x.to(torch.bfloat16)`` gives: the high 16 bits rounded to nearest, ties to even
    (infinities and overflow to infinity follow from the carry), every NaN ``0xFFFF``."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the kept part's lowest bit rounds half to even in one integer add.
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), _BF16_NAN, rounded)


def to_record(t: WireTensor) -> dict[str, Any]:
    """Avro ``epd.Tensor`` record of a wire tensor (its bytes, one copy)."""
    return {"dtype": t.dtype, "shape": list(t.shape), "data": t.data.tobytes()}


def from_record(rec: dict[str, Any]) -> WireTensor:
    """A wire tensor from an Avro ``epd.Tensor`` record (a view over its bytes)."""
    return WireTensor.from_bytes(rec["dtype"], rec["shape"], rec["data"])
