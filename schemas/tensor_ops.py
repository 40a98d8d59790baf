"""The few things the contract's rules ask of an inline tensor, for both of its forms: a
``torch.Tensor`` (every worker that computes) and a :class:`~schemas.wire_tensor.WireTensor`
(the render router, which imports no torch).

The validator, the content hash and the stores' byte layout call these instead of torch, so
each rule is written once and holds for both. Nothing here imports torch: an object can only be
a torch tensor in a process that imported torch already, so the check looks there
(``sys.modules``) and the torch branch uses the tensor's own methods.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from schemas.wire_tensor import WireTensor


def is_torch(v: object) -> bool:
    """Whether ``v`` is a ``torch.Tensor`` (False, without importing torch, where none is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, torch.Tensor)


def is_tensor(v: object) -> bool:
    """Whether ``v`` is an inline tensor in either form (not a claim check)."""
    return isinstance(v, WireTensor) or is_torch(v)


def dtype_name(v: Any) -> str:
    """The wire name of an inline tensor's dtype (``float32``, ``bfloat16``, ...)."""
    if isinstance(v, WireTensor):
        return v.dtype
    return str(v.dtype).removeprefix("torch.")


def dtype_label(v: Any) -> str:
    """The dtype as messages name it: torch's spelling (``torch.int64``) for both forms, so a
    rejection reads the same whichever process made it."""
    return f"torch.{v.dtype}" if isinstance(v, WireTensor) else str(v.dtype)


def nbytes(v: Any) -> int:
    """Bytes of an inline tensor's data."""
    return int(v.numel() * v.element_size())


def int_rows(v: Any, width: int) -> list[list[Any]]:
    """The elements as Python numbers, ``width`` to a row (a grid's ``(t, h, w)`` rows)."""
    if isinstance(v, WireTensor):
        return list(v.values().reshape(-1, width).tolist())
    return list(v.reshape(-1, width).tolist())


def flat_values(v: Any) -> list[Any]:
    """Every element as a Python number (``bool``, ``int`` or ``float``), in C order."""
    if isinstance(v, WireTensor):
        return list(v.values().reshape(-1).tolist())
    return list(v.reshape(-1).tolist())


def all_finite(v: Any) -> bool:
    """Whether a floating tensor holds no NaN or Inf.

    A finite sum settles it in one pass without a temporary (NaN and Inf both carry through a
    sum): 25x faster than the elementwise test on a 1.2 MB tensor. Only a sum that is not
    finite, which large finite values can also give by overflowing, takes the exact test.
    """
    if isinstance(v, WireTensor):
        values = v.values()
        # Summed in float64: a float32 or narrower tensor's sum cannot overflow there.
        if np.isfinite(values.sum(dtype=np.float64)):
            return True
        return bool(np.isfinite(values).all())
    torch = sys.modules["torch"]
    if bool(torch.isfinite(v.sum())):
        return True
    return bool(torch.isfinite(v).all())


def raw_view(v: Any) -> memoryview:
    """The tensor's raw little-endian C-order bytes as a flat byte view (torch: copied only if
    it is not contiguous on the CPU)."""
    if isinstance(v, WireTensor):
        return v.data
    t = v.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    torch = sys.modules["torch"]
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def cast(v: Any, dtype: str) -> Any:
    """``v`` in the wire dtype ``dtype`` (the same form back; torch's ``.to``)."""
    if isinstance(v, WireTensor):
        return v.cast(dtype)
    from schemas.tensors import torch_dtype  # a torch tensor: torch is loaded already

    return v.to(torch_dtype(dtype))


def is_contiguous(v: Any) -> bool:
    """Whether ``v``'s elements lie in C order (a wire tensor's always do)."""
    return isinstance(v, WireTensor) or bool(v.is_contiguous())


def wire_dtype(v: Any) -> str:
    """:func:`dtype_name`, refusing (``CodecError``) a torch dtype the wire cannot carry."""
    if isinstance(v, WireTensor):
        return v.dtype
    from schemas.tensors import dtype_name as torch_dtype_name  # torch is loaded already

    return torch_dtype_name(v.dtype)


def byte_tensor(v: Any) -> Any:
    """The tensor's bytes as a flat uint8 tensor of the same form, viewing them (no copy): what
    a store parks for a claim check. ``v`` must be contiguous (:func:`is_contiguous`)."""
    if isinstance(v, WireTensor):
        return WireTensor("uint8", (v.nbytes,), v.data)
    torch = sys.modules["torch"]
    return v.reshape(-1).view(torch.uint8)


def to_torch(v: Any) -> Any:
    """``v`` as a ``torch.Tensor`` (a wire tensor: a view over its bytes; imports torch)."""
    if not isinstance(v, WireTensor):
        return v
    from schemas.tensors import tensor_from_bytes

    return tensor_from_bytes(v.dtype, list(v.shape), v.data)


def detached(v: Any) -> Any:
    """``v`` cut from any autograd graph (a wire tensor has none)."""
    return v if isinstance(v, WireTensor) else v.detach()
