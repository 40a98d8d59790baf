"""The codec's tensor leaves: claim checks both ways, wire tensors both ways, and the hand-off
of a ``torch.Tensor`` to :mod:`schemas.tensors` (imported only then: this module needs no torch).

Every codec encodes through :func:`value_to_avro` and :func:`tensor_to_record`, so a process
holding only :class:`~schemas.wire_tensor.WireTensor` values (the render router) sends its
events without importing torch. Decoding picks the form: the default codec makes torch tensors
(:func:`value_from_avro`, ``schemas.tensors.tensor_from_record``), the wire codec
(``schemas.codec.wire_codec``) wire tensors (:func:`wire_value_from_avro`,
:func:`wire_tensor_from_record`).
"""

from __future__ import annotations

from typing import Any

from schemas import tensor_ops
from schemas.errors import CodecError
from schemas.types import TensorLike, TensorRef
from schemas.wire_tensor import WireTensor, from_record, nbytes_of, to_record


def ref_to_avro(ref: TensorRef) -> dict[str, Any]:
    """Avro ``epd.TensorRef`` record of a claim check."""
    return {
        "store": ref.store,
        "key": ref.key,
        "dtype": ref.dtype,
        "shape": list(ref.shape),
        "nbytes": ref.nbytes,
        "digest": ref.digest,
    }


def ref_from_avro(rec: dict[str, Any]) -> TensorRef:
    """A claim check from its Avro record; CodecError when its ``nbytes`` is not its size."""
    ref = TensorRef(
        store=rec["store"],
        key=rec["key"],
        dtype=rec["dtype"],
        shape=list(rec["shape"]),
        nbytes=rec["nbytes"],
        digest=rec["digest"],
    )
    if ref.nbytes != nbytes_of(ref.dtype, ref.shape):
        raise CodecError(
            f"TensorRef {ref.key!r}: nbytes {ref.nbytes} does not match dtype {ref.dtype} "
            f"shape {ref.shape}"
        )
    return ref


def tensor_to_record(t: Any) -> dict[str, Any]:
    """Avro ``epd.Tensor`` record of an inline tensor in either form."""
    if isinstance(t, WireTensor):
        return to_record(t)
    from schemas import tensors  # a torch tensor: torch is loaded already

    return tensors.tensor_to_record(t)


def value_to_avro(v: TensorLike) -> tuple[str, dict[str, Any]]:
    """Union branch for a ``Tensor | TensorRef`` map value (explicit, so fastavro never guesses)."""
    if isinstance(v, TensorRef):
        return ("epd.TensorRef", ref_to_avro(v))
    if tensor_ops.is_tensor(v):
        return ("epd.Tensor", tensor_to_record(v))
    raise CodecError(f"expected a torch.Tensor or TensorRef, got {type(v).__name__}")


def value_from_avro(rec: dict[str, Any]) -> TensorLike:
    """Inverse of :func:`value_to_avro` for the default codec (torch tensors); a TensorRef is
    recognised by its ``key`` field."""
    if "key" in rec:
        return ref_from_avro(rec)
    from schemas import tensors  # a tensor to make: torch

    return tensors.tensor_from_record(rec)


def wire_value_from_avro(rec: dict[str, Any]) -> TensorRef | WireTensor:
    """Inverse of :func:`value_to_avro` for the wire codec; a TensorRef is recognised by its
    ``key`` field."""
    if "key" in rec:
        return ref_from_avro(rec)
    return from_record(rec)


def wire_tensor_from_record(rec: dict[str, Any]) -> WireTensor:
    """A wire tensor from an Avro ``epd.Tensor`` record (a view over its bytes)."""
    return from_record(rec)
