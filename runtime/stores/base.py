"""The embedding-store interface and the value layout shared by byte stores (the typed errors:
:mod:`runtime.stores.errors`).

A store parks tensors (encoder outputs, claim-checked encoder inputs) under string keys. Every
backend speaks the same async interface, so workers pick one by URI and never branch on it.

Value layout (``redis://`` and ``shm://``): one self-describing blob, a small header followed by
the tensor's raw little-endian C-order bytes, so a reader needs nothing but the key::

    magic "EPDT" | version u8 | dtype-name length u8 | ndim u16 | expires_ms i64 |
    dtype name (ascii) | shape (ndim x i64) | zero padding to a multiple of 64 | data

An entry of several named tensors (an item's encoder outputs: Qwen3-VL's embedding plus its
deepstack features) is one value too, so it has one key, one TTL and one readiness signal; see
:func:`pack_tensors` for its layout and its digest.

The data starts on a 64-byte boundary of the blob so a view over it (``torch.frombuffer`` over an
``mmap``) is aligned for every dtype. ``expires_ms`` is wall-clock epoch milliseconds, 0 for none;
Redis expires keys itself (its blobs carry 0); shm keeps the expiry in the file's mtime, which its
reads go by, and mirrors it here (``touch`` rewrites just this field, at :data:`EXPIRES_OFFSET`).
"""

from __future__ import annotations

import abc
import mmap
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3

from runtime.stores.errors import StoreCorrupt, StoreKeyMissing
from schemas import tensor_ops
from schemas.errors import CodecError
from schemas.wire_tensor import nbytes_of

if TYPE_CHECKING:
    import torch


class EmbeddingStore(abc.ABC):
    """Async key -> tensor store with TTLs and a readiness wait that never busy-polls."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URI this store was opened with (goes into ``ECTransfer.store`` / ``TensorRef``)."""

    @abc.abstractmethod
    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        """Store ``tensor`` under ``key`` (replacing any value) and wake waiters on it.

        Every store but ``cuda://`` also takes a :class:`schemas.wire_tensor.WireTensor` (the
        render router's claim checks): what is stored is its dtype, shape and bytes either way,
        and it reads back as a torch tensor."""

    @abc.abstractmethod
    async def get(self, key: str) -> torch.Tensor:
        """The tensor under ``key``; raises :class:`StoreKeyMissing` when absent or expired."""

    async def get_many(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """Tensors for ``keys`` in order; :class:`StoreKeyMissing` names every missing key."""
        out: list[torch.Tensor] = []
        missing: list[str] = []
        for k in keys:
            try:
                out.append(await self.get(k))
            except StoreKeyMissing:
                missing.append(k)
        if missing:
            raise StoreKeyMissing(missing)
        return out

    @abc.abstractmethod
    async def exists(self, key: str) -> bool:
        """True when ``key`` holds a live (unexpired) value."""

    @abc.abstractmethod
    async def touch(self, key: str, ttl_s: float | None) -> bool:
        """Extend the key's lifetime to ``ttl_s`` from now (None: no expiry); False when the key
        is absent or expired (it is not created).

        A cache hit must be a successful ``touch``, not ``exists``: whoever hands out a key on
        the strength of a hit promises the value lives ``ttl_s`` longer, and ``exists`` would let
        a value with a second left count as cached and vanish before its reader comes.
        """

    @abc.abstractmethod
    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        """Return once every key exists; raise :class:`StoreTimeout` naming the missing ones.

        Implementations register for wake-ups *before* checking what is already there, so a put
        that lands between the check and the sleep is never lost, and they sleep on a real
        notification (pub/sub, inotify, futures) rather than polling.
        """

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are fine."""

    async def put_bytes(
        self, key: str, data: bytes | memoryview, ttl_s: float | None = None
    ) -> None:
        """Store raw bytes (a claim-checked payload); read back with :meth:`get_bytes`."""
        import torch

        buf = memoryview(data).cast("B")
        if len(buf):
            t = torch.frombuffer(buf, dtype=torch.uint8)
        else:
            t = torch.empty(0, dtype=torch.uint8)
        await self.put(key, t, ttl_s)

    async def get_bytes(self, key: str) -> bytes:
        """The raw bytes under ``key`` (for a tensor value: its little-endian data bytes)."""
        return tensor_ops.raw_view(await self.get(key)).tobytes()

    async def put_tensors(
        self, key: str, tensors: Mapping[str, torch.Tensor], ttl_s: float | None = None
    ) -> None:
        """Store several named tensors as ONE entry (one key, one TTL, one digest over all of
        them); read back with :meth:`get_tensors`. Waiters wake once, when all are there."""
        await self.put_bytes(key, memoryview(pack_tensors(tensors)), ttl_s)

    async def get_tensors(self, key: str) -> dict[str, torch.Tensor]:
        """The named tensors of a :meth:`put_tensors` entry, digest checked.

        Raises :class:`StoreKeyMissing` when absent and :class:`StoreCorrupt` when the value is
        not such an entry or its digest does not match.
        """
        return unpack_tensors(_uint8_view(await self.get(key)), key)

    async def get_tensors_many(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """:meth:`get_tensors` for several keys (one round trip where the backend batches)."""
        values = await self.get_many(keys)
        return [unpack_tensors(_uint8_view(v), k) for k, v in zip(keys, values, strict=True)]

    async def close(self) -> None:  # noqa: B027 - optional hook, most stores need it
        """Release connections, watches and background tasks. Idempotent."""

    async def __aenter__(self) -> EmbeddingStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# --- blob layout shared by the byte-oriented stores ------------------------------------------

Blob = bytes | bytearray | memoryview | mmap.mmap
"""Anything a stored value can be read from without copying."""

MAGIC = b"EPDT"
VERSION = 1
_FIXED = struct.Struct("<4sBBHq")
ALIGN = 64
EXPIRES = struct.Struct("<q")
EXPIRES_OFFSET = _FIXED.size - EXPIRES.size
"""Where ``expires_ms`` sits in a blob (a store may rewrite just that field to extend a TTL)."""
HEADER_MIN = _FIXED.size
"""The smallest well-formed header, in bytes."""


@dataclass(frozen=True, slots=True)
class BlobHeader:
    """Decoded header of a stored blob; ``data_offset`` is where the tensor bytes start."""

    dtype: str
    shape: list[int]
    expires_ms: int
    data_offset: int

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    def expired(self, now_ms: int | None = None) -> bool:
        if self.expires_ms <= 0:
            return False
        return (now_ms if now_ms is not None else int(time.time() * 1000)) >= self.expires_ms


def expiry_ms(ttl_s: float | None) -> int:
    """Absolute epoch-ms expiry for a TTL (0 = never). A TTL must be positive."""
    if ttl_s is None:
        return 0
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
    return int(time.time() * 1000) + max(1, int(ttl_s * 1000))


def encode_header(tensor: Any, expires_ms: int = 0) -> bytes:
    """The header (padded to :data:`ALIGN`) describing ``tensor`` (torch or wire)."""
    name = tensor_ops.wire_dtype(tensor).encode("ascii")
    shape = list(tensor.shape)
    head = _FIXED.pack(MAGIC, VERSION, len(name), len(shape), expires_ms)
    head += name + struct.pack(f"<{len(shape)}q", *shape)
    return head + b"\0" * (-len(head) % ALIGN)


def tensor_view(tensor: Any) -> memoryview:
    """The tensor's raw bytes as a memoryview, copying only if it is not contiguous on the CPU."""
    return tensor_ops.raw_view(tensor)


def decode_header(blob: Blob, key: str = "?") -> BlobHeader:
    """Parse and check a blob header; raises :class:`StoreCorrupt` naming the key."""
    if len(blob) < _FIXED.size:
        raise StoreCorrupt(f"store value for {key!r} is truncated ({len(blob)} bytes)")
    magic, version, name_len, ndim, expires = _FIXED.unpack_from(blob, 0)
    if magic != MAGIC:
        raise StoreCorrupt(f"store value for {key!r} has bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise StoreCorrupt(f"store value for {key!r} has unsupported version {version}")
    pos = _FIXED.size
    end = pos + name_len + 8 * ndim
    if len(blob) < end:
        raise StoreCorrupt(f"store value for {key!r} has a truncated header")
    name = bytes(blob[pos : pos + name_len]).decode("ascii", "replace")
    shape = list(struct.unpack_from(f"<{ndim}q", blob, pos + name_len))
    data_offset = end + (-end % ALIGN)
    header = BlobHeader(name, shape, expires, data_offset)
    try:
        need = header.nbytes
    except CodecError as exc:
        raise StoreCorrupt(f"store value for {key!r}: {exc}") from None
    if any(d < 0 for d in shape) or len(blob) != data_offset + need:
        raise StoreCorrupt(
            f"store value for {key!r}: dtype {name} shape {shape} needs {need} data bytes, "
            f"blob holds {len(blob) - data_offset}"
        )
    return header


def tensor_from_blob(blob: Blob, header: BlobHeader) -> torch.Tensor:
    """A tensor viewing the blob's data without copying (the blob stays alive through it)."""
    import torch  # a reader's: the processes that read stored tensors compute with them

    from schemas.tensors import torch_dtype

    dt = torch_dtype(header.dtype)
    numel = 1
    for d in header.shape:
        numel *= d
    if numel == 0:
        return torch.empty(header.shape, dtype=dt)
    flat = torch.frombuffer(blob, dtype=dt, offset=header.data_offset, count=numel)
    return flat.view(header.shape)


# --- multi-tensor entries --------------------------------------------------------------------

MULTI_MAGIC = b"EPDM"
MULTI_VERSION = 1
_MULTI_HEAD = struct.Struct("<4sBxH32s")  # magic, version, pad, count, blake3 digest
_MULTI_ITEM = struct.Struct("<HBBQ")  # name length, dtype-name length, ndim, data bytes
MULTI_MAX_TENSORS = 64


def _align(n: int) -> int:
    return n + (-n % ALIGN)


def pack_tensors(tensors: Mapping[str, torch.Tensor]) -> bytearray:
    """One blob holding several named tensors (the value of a multi-tensor entry)::

        magic "EPDM" | version u8 | pad u8 | count u16 | blake3 digest (32 bytes) |
        per tensor, in the given order:
            name length u16 | dtype-name length u8 | ndim u8 | data bytes u64 |
            name (utf-8) | dtype name (ascii) | shape (ndim x i64) |
            zero padding to a multiple of 64 | little-endian C-order data

    The digest covers everything after it, so a reader detects any torn or foreign value.
    Every tensor's data starts on a 64-byte boundary of the blob (aligned views on read).
    """
    if not tensors:
        raise ValueError("a multi-tensor entry needs at least one tensor")
    if len(tensors) > MULTI_MAX_TENSORS:
        raise ValueError(f"{len(tensors)} tensors; a multi-tensor entry holds at most 64")
    parts: list[tuple[bytes, memoryview]] = []
    size = _MULTI_HEAD.size
    for name, t in tensors.items():
        nm = name.encode()
        dt = tensor_ops.wire_dtype(t).encode("ascii")
        data = tensor_view(t)
        head = _MULTI_ITEM.pack(len(nm), len(dt), len(t.shape), data.nbytes) + nm + dt
        head += struct.pack(f"<{len(t.shape)}q", *t.shape)
        parts.append((head, data))
        size = _align(size + len(head)) + data.nbytes
    out = bytearray(size)
    pos = _MULTI_HEAD.size
    for head, data in parts:
        out[pos : pos + len(head)] = head
        pos = _align(pos + len(head))
        out[pos : pos + data.nbytes] = data
        pos += data.nbytes
    digest = blake3.blake3(memoryview(out)[_MULTI_HEAD.size :]).digest()
    _MULTI_HEAD.pack_into(out, 0, MULTI_MAGIC, MULTI_VERSION, len(parts), digest)
    return out


def _uint8_view(t: torch.Tensor) -> memoryview:
    if tensor_ops.dtype_name(t) != "uint8" or len(t.shape) != 1:
        return memoryview(b"")  # not a packed entry: unpack_tensors names the key
    return tensor_view(t)


def unpack_tensors(blob: Blob, key: str = "?") -> dict[str, torch.Tensor]:
    """The named tensors of a :func:`pack_tensors` blob, viewing it without copying.

    Raises :class:`StoreCorrupt` naming the key for anything else: a single-tensor value, a
    truncated blob, a digest mismatch.
    """
    buf = memoryview(blob).cast("B") if not isinstance(blob, memoryview) else blob.cast("B")
    if len(buf) < _MULTI_HEAD.size:
        raise StoreCorrupt(f"store value for {key!r} is not a multi-tensor entry")
    magic, version, count, digest = _MULTI_HEAD.unpack_from(buf, 0)
    if magic != MULTI_MAGIC:
        raise StoreCorrupt(f"store value for {key!r} is not a multi-tensor entry")
    if version != MULTI_VERSION:
        raise StoreCorrupt(f"multi-tensor entry {key!r} has unsupported version {version}")
    if blake3.blake3(buf[_MULTI_HEAD.size :]).digest() != digest:
        raise StoreCorrupt(f"multi-tensor entry {key!r} fails its digest check")
    out: dict[str, torch.Tensor] = {}
    pos = _MULTI_HEAD.size
    try:
        for _ in range(count):
            name_len, dt_len, ndim, nbytes = _MULTI_ITEM.unpack_from(buf, pos)
            pos += _MULTI_ITEM.size
            name = bytes(buf[pos : pos + name_len]).decode()
            pos += name_len
            dt = bytes(buf[pos : pos + dt_len]).decode("ascii")
            pos += dt_len
            shape = list(struct.unpack_from(f"<{ndim}q", buf, pos))
            pos = _align(pos + 8 * ndim)
            if nbytes != nbytes_of(dt, shape) or pos + nbytes > len(buf):
                raise StoreCorrupt(f"multi-tensor entry {key!r}: tensor {name!r} is truncated")
            header = BlobHeader(dt, shape, 0, pos)
            out[name] = tensor_from_blob(buf[: pos + nbytes], header)
            pos += nbytes
    except (struct.error, UnicodeDecodeError, CodecError) as exc:
        raise StoreCorrupt(f"multi-tensor entry {key!r} is malformed: {exc}") from None
    if pos != len(buf):
        raise StoreCorrupt(f"multi-tensor entry {key!r} has {len(buf) - pos} trailing bytes")
    return out
