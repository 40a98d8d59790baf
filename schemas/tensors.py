"""Tensors as raw little-endian bytes: encode with one copy, decode with none.

The torch form of the wire's tensors; the torch-free form (the render router's) is
:mod:`schemas.wire_tensor`; the codec's leaves (claim checks, and the choice of form) are
:mod:`schemas.tensor_codec`.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import Any

import torch

from schemas.errors import CodecError
from schemas.types import DTYPE_SIZES
from schemas.wire_tensor import nbytes_of as nbytes_of  # re-exported: its home is torch-free

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("epd-pipeline's tensor wire format assumes a little-endian host")

# torch.frombuffer warns once per process that a read-only buffer backs the tensor. Decoded
# tensors are inputs we never write into, so the warning is noise.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES}
"""The wire's dtypes (``schemas.types.DTYPE_SIZES``, named as torch names them) as torch's."""
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
if any(DTYPES[name].itemsize != size for name, size in DTYPE_SIZES.items()):
    raise AssertionError("schemas.types.DTYPE_SIZES disagrees with torch's element sizes")


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype (``bfloat16``, ``int64``, ...)."""
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise CodecError(f"dtype {dtype} is not supported on the wire") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire name; raises CodecError for an unknown one."""
    try:
        return DTYPES[name]
    except KeyError:
        raise CodecError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}") from None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw little-endian C-order bytes of a CPU tensor (one copy)."""
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(dtype: str, shape: list[int], data: bytes | memoryview) -> torch.Tensor:
    """A tensor viewing ``data`` without a copy. Checks ``prod(shape) * itemsize == len(data)``."""
    td = torch_dtype(dtype)
    if any((not isinstance(d, int)) or d < 0 for d in shape):
        raise CodecError(f"invalid tensor shape {shape}: dimensions must be non-negative ints")
    expected = math.prod(shape) * td.itemsize
    if expected != len(data):
        raise CodecError(
            f"tensor size mismatch: dtype {dtype} shape {list(shape)} needs {expected} bytes, "
            f"got {len(data)}"
        )
    if expected == 0:
        return torch.empty(shape, dtype=td)
    return torch.frombuffer(data, dtype=td).view(shape)


def tensor_to_record(t: torch.Tensor) -> dict[str, Any]:
    """Avro ``epd.Tensor`` record for a tensor."""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": tensor_bytes(t)}


def tensor_from_record(rec: dict[str, Any]) -> torch.Tensor:
    """Tensor from an Avro ``epd.Tensor`` record (zero-copy view over its bytes)."""
    return tensor_from_bytes(rec["dtype"], rec["shape"], rec["data"])
