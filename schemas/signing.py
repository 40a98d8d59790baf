"""HMAC signatures on ``ec_transfer_params`` entries and parked-KV entries, the embedding,
claim and KV key layout, and the content hash an embedding is keyed by.

The fan-out signs each entry; the prefill side checks the signature and that the key stays
inside the configured namespace, so a forged event cannot point a worker at another tenant's
embeddings. The key's hash is never taken from an event: the fan-out computes it with
:class:`ItemHasher` over what the encoder will actually run on (the renderer uses the same
function, so the ``mm_hash`` it labels an item with is that same hash).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import blake3

from schemas import tensor_ops
from schemas.types import ECTransfer, KVTransfer, TensorLike, TensorRef
from schemas.wire_tensor import WireTensor

_SIGNATURE_TAG = b"epd-ec-v2"
_HASH_TAG = b"epd-mm-v2"
# Above this, blake3 hashes on all cores (a 1024x1024 image's pixel_values are 25.8 MB); below
# it the threads' wake-ups cost more CPU than they save wall time (a 224x224 image's 1.2 MB:
# 0.18 ms of CPU on one thread, 0.24 ms spread over two cores on the benchmark's machine).
_PARALLEL_HASH_BYTES = 4 << 20

INLINE_DIGEST_BYTES = 1 << 20
"""Bytes up to which a digest is made on the event loop (blake3: well under a millisecond, less
than a worker thread's hand-off costs); more are digested in a worker thread."""


def _framed(*fields: bytes) -> bytes:
    # Each field carries its 8-byte length, so no choice of field contents can make two
    # different field lists serialise alike (a separator can appear inside a field; a length
    # prefix cannot be forged by one).
    return b"".join(len(f).to_bytes(8, "big") + f for f in fields)


def _opt(value: str | None) -> bytes:
    # Presence byte first: None and "" are different values.
    return b"\x00" if value is None else b"\x01" + value.encode()


def ec_message(
    *, request_id: str | None, mm_hash: str, store: str, key: str, expires_ms: int
) -> bytes:
    """The bytes an entry's HMAC covers: a version tag and every field, length-prefixed.

    ``request_id`` binds the entry to one request, so an entry captured from one event cannot be
    replayed into another. ``None`` is an entry bound to no request (the vLLM JSON split has no
    stable request id across its encode and prefill bodies); the pipeline's workers always verify
    with the event's request id, so they refuse such an entry.
    """
    return _framed(
        _SIGNATURE_TAG,
        _opt(request_id),
        mm_hash.encode(),
        store.encode(),
        key.encode(),
        str(int(expires_ms)).encode(),
    )


def sign_ec(
    secret: bytes,
    *,
    mm_hash: str,
    store: str,
    key: str,
    expires_ms: int,
    request_id: str | None = None,
) -> str:
    """Hex HMAC-SHA256 over one entry's fields and the request it belongs to."""
    msg = ec_message(
        request_id=request_id, mm_hash=mm_hash, store=store, key=key, expires_ms=expires_ms
    )
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def make_ec_transfer(
    *,
    mm_hash: str,
    store: str,
    key: str,
    expires_ms: int,
    secret: bytes | None,
    request_id: str | None = None,
) -> ECTransfer:
    """An ``ec_transfer_params`` entry, signed (for ``request_id``) when a secret is configured."""
    sig = (
        sign_ec(
            secret,
            mm_hash=mm_hash,
            store=store,
            key=key,
            expires_ms=expires_ms,
            request_id=request_id,
        )
        if secret
        else ""
    )
    return ECTransfer(mm_hash=mm_hash, store=store, key=key, expires_ms=expires_ms, signature=sig)


def verify_ec(secret: bytes, ec: ECTransfer, *, request_id: str | None = None) -> bool:
    """True when the entry's signature matches its fields and ``request_id`` under ``secret``
    (constant time). Verify with the request id of the event that carries the entry."""
    expected = sign_ec(
        secret,
        mm_hash=ec.mm_hash,
        store=ec.store,
        key=ec.key,
        expires_ms=ec.expires_ms,
        request_id=request_id,
    )
    return hmac.compare_digest(expected, ec.signature)


# ---------------------------------------------------------------------------------------------
# Parked KV caches (the decode stage)

_KV_TAG = b"epd-kv-v1"


def kv_message(kv: KVTransfer, request_id: str) -> bytes:
    """The bytes a KV entry's HMAC covers: a version tag, the request and every field but the
    signature, length-prefixed (so the entry cannot be replayed into another request, nor its
    shapes or resume position changed)."""
    return _framed(
        _KV_TAG,
        request_id.encode(),
        kv.store.encode(),
        kv.key.encode(),
        str(int(kv.expires_ms)).encode(),
        f"{kv.layers}:{kv.kv_heads}:{kv.head_dim}:{kv.dtype}".encode(),
        str(int(kv.seq_len)).encode(),
        ",".join(str(int(p)) for p in kv.next_position).encode(),
        str(int(kv.nbytes)).encode(),
    )


def sign_kv(secret: bytes | None, kv: KVTransfer, request_id: str) -> KVTransfer:
    """``kv`` with its signature for ``request_id`` (unsigned without a secret)."""
    sig = hmac.new(secret, kv_message(kv, request_id), hashlib.sha256).hexdigest() if secret else ""
    return dataclasses.replace(kv, signature=sig)


def verify_kv(secret: bytes, kv: KVTransfer, request_id: str) -> bool:
    """True when the KV entry's signature matches its fields and ``request_id`` (constant
    time)."""
    expected = hmac.new(secret, kv_message(kv, request_id), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, kv.signature)


# ---------------------------------------------------------------------------------------------
# Content hash


def processor_digest(processor_config: Mapping[str, Any]) -> bytes:
    """blake3 of a processor config (``image_processor.to_dict()``), canonical JSON."""
    canonical = json.dumps(processor_config, sort_keys=True, default=str)
    return blake3.blake3(canonical.encode()).digest()


DIGEST_MEMO_ATTR = "_epd_blake3"
"""Attribute a digested tensor carries: (its version counter when hashed, the digest)."""


def tensor_digest(t: Any) -> str:
    """blake3 hex of a tensor's raw little-endian C-order bytes: the ``TensorRef.digest`` of it.
    The same for a ``torch.Tensor`` and a :class:`WireTensor` of one dtype, shape and bytes
    (the bytes alone are hashed; dtype and shape go into :class:`ItemHasher`'s hash).

    Hashes a view of the tensor's memory (no copy of the bytes), multithreaded when large. A
    torch tensor's digest is remembered on the tensor object with its version counter, so
    hashing the same, unmodified tensor again (the renderer hashed it, then the fan-out in the
    same process) is free; an in-place change bumps the counter and is hashed anew. A tensor
    decoded from the wire is a new object: it is always hashed.
    """
    if isinstance(t, WireTensor):  # immutable, and hashed once per object by the fan-out
        return _digest(t)
    if (known := _remembered(t)) is not None:
        return known
    digest = _digest(t)
    if (version := _version(t)) is not None:
        with contextlib.suppress(AttributeError, RuntimeError):  # takes no attribute
            setattr(t, DIGEST_MEMO_ATTR, (version, digest))
    return digest


def undigested_bytes(values: Iterable[Any]) -> int:
    """The bytes :func:`tensor_digest` would read to digest ``values``: a torch tensor whose
    digest it remembers, a claim check or a value that is no tensor reads none."""
    total = 0
    for v in values:
        if isinstance(v, WireTensor):
            total += len(v.data)
        elif tensor_ops.is_tensor(v) and _remembered(v) is None:
            total += tensor_ops.nbytes(v)
    return total


def _version(t: Any) -> int | None:
    """A torch tensor's version counter (None: an inference-mode tensor keeps none, so its
    digest is never remembered)."""
    try:
        return int(t._version)
    except RuntimeError:
        return None


def _remembered(t: Any) -> str | None:
    """The digest remembered on torch tensor ``t`` for its current contents, if any."""
    memo = getattr(t, DIGEST_MEMO_ATTR, None)
    version = _version(t)
    return str(memo[1]) if memo is not None and version is not None and memo[0] == version else None


def _digest(t: Any) -> str:
    raw = tensor_ops.raw_view(t)
    threads = blake3.blake3.AUTO if raw.nbytes > _PARALLEL_HASH_BYTES else 1
    return blake3.blake3(raw, max_threads=threads).hexdigest()


def _dtype_name(v: TensorLike) -> str:
    return v.dtype if isinstance(v, TensorRef) else tensor_ops.dtype_name(v)


@dataclass(frozen=True, slots=True)
class ItemHasher:
    """The ``mm_hash`` of an item for one model and processor config.

    The hash is blake3 over a version tag, the modality, the model fingerprint, the processor
    config digest, the tenant's ``cache_salt`` and, for every field of the item's encoder inputs
    (``pixel_values``, ``image_grid_thw``, ...) in name order: its name, dtype, shape and the
    blake3 digest of its raw bytes. Every part is length-prefixed.

    Hashing the per-field digest instead of the bytes themselves is what lets a claim-checked
    input (``TensorRef``) be hashed without fetching its megabytes: the ref carries the digest
    of its bytes, and the encode worker refuses bytes that do not match that digest, so the
    hash still commits to what gets encoded. Inline tensors are digested here; the renderer
    hashes through the same function, so both sides always agree whether a field travels inline
    or by claim check.
    """

    model_fingerprint: str
    processor_digest: bytes

    @classmethod
    def for_processor(
        cls, model_fingerprint: str, processor_config: Mapping[str, Any]
    ) -> ItemHasher:
        """A hasher for a model fingerprint and its processor's ``to_dict()`` config."""
        return cls(model_fingerprint, processor_digest(processor_config))

    def item_hash(
        self,
        modality: str,
        data: Mapping[str, TensorLike],
        cache_salt: str | None,
        *,
        digests: Mapping[str, str] | None = None,
    ) -> str:
        """The hash of one item's encoder inputs. ``digests`` (field name -> blake3 hex of
        its bytes) skips re-hashing inline tensors whose digest the caller already has."""
        fields: list[bytes] = [
            _HASH_TAG,
            modality.encode(),
            self.model_fingerprint.encode(),
            self.processor_digest,
            _opt(cache_salt),
        ]
        for name in sorted(data):
            v = data[name]
            if isinstance(v, TensorRef):
                digest = v.digest
            elif digests is not None and name in digests:
                digest = digests[name]
            else:
                digest = tensor_digest(v)
            shape = ",".join(str(int(d)) for d in v.shape)
            fields += [name.encode(), _dtype_name(v).encode(), shape.encode(), digest.encode()]
        return blake3.blake3(_framed(*fields)).hexdigest()
