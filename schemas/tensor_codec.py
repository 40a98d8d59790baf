"""The codec's tensor leaves that need no torch: claim checks both ways, wire tensors both
ways, and the dispatch that hands a ``torch.Tensor`` to :mod:`schemas.tensors`.

Every codec encodes through :func:`value_to_avro` and :func:`tensor_to_record`, so a process
holding only :class:`~schemas.wire_tensor.WireTensor` values (the render router) sends its
events without importing torch. Decoding picks the form: the default codec makes torch tensors
(:mod:`schemas.tensors`), the wire codec (``schemas.codec.wire_codec``) makes wire tensors with
:func:`wire_value_from_avro` and :func:`wire_tensor_from_record`.
"""

from __future__ import annotations

from typing import Any

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
    if isinstance(v, WireTensor):
        return ("epd.Tensor", to_record(v))
    from schemas import tensors  # a torch tensor (or a wrong value, which it names)

    return tensors.value_to_avro(v)


def wire_value_from_avro(rec: dict[str, Any]) -> TensorRef | WireTensor:
    """Inverse of :func:`value_to_avro` for the wire codec; a TensorRef is recognised by its
    ``key`` field."""
    if "key" in rec:
        return ref_from_avro(rec)
    return from_record(rec)


def wire_tensor_from_record(rec: dict[str, Any]) -> WireTensor:
    """A wire tensor from an Avro ``epd.Tensor`` record (a view over its bytes)."""
    return from_record(rec)
