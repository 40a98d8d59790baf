"""The parts of ``cuda://`` that need no GPU: the index record's wire layout, the slot allocator.

Index record: what a reader in another process needs to find an entry in the producer's device
memory, as explicit little-endian fields (never pickle)::

    magic "EPDC" | version u8 | dtype-name length u8 | ndim u8 | event_sync_required u8 |
    producer id (16 bytes) | chunk id (16 bytes) | device UUID (16 bytes) |
    generation u64 | device i32 | pad u32 |
    offset u64 | nbytes u64 | storage_size_bytes u64 | storage_offset_bytes u64 |
    ref_counter_offset u64 | handle length u16 | ref-counter-handle length u16 |
    event-handle length u16 | pad u16 |
    handle | ref counter handle | event handle | dtype name (ascii) | shape (ndim x i64)

The IPC fields (``handle`` .. ``event_sync_required``) are the ones
``torch.multiprocessing.reductions.reduce_tensor`` returns for the producer's chunk and
``rebuild_cuda_tensor`` takes back; ``offset``/``nbytes`` place the entry inside that chunk.
``device`` is the producer's device *index*, which means nothing to a reader started with
another ``CUDA_VISIBLE_DEVICES``: readers find the GPU by its UUID (what
``torch.cuda.get_device_properties(i).uuid`` gives) and keep the index only for messages.
A chunk that cannot be shared (the CPU test mode) has an empty ``handle`` and a zero UUID.
Version 2 added the UUID; a version-1 record is refused as corrupt (it could open the wrong GPU).
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

from runtime.stores.errors import StoreCorrupt
from schemas.errors import CodecError
from schemas.tensors import nbytes_of

RECORD_MAGIC = b"EPDC"
RECORD_VERSION = 2
_HEAD = struct.Struct("<4sBBBB16s16s16sQiIQQQQQHHHH")
SLOT_ALIGN = 256
"""Entries start on this boundary of their chunk (CUDA's own allocation alignment)."""


@dataclass(frozen=True, slots=True)
class ChunkShare:
    """The IPC fields of one shared chunk (a device buffer holding many entries)."""

    chunk_id: bytes  # 16 bytes, unique per chunk
    device: int  # the producer's device index (for messages: readers go by device_uuid)
    device_uuid: bytes  # 16 bytes, the GPU's UUID; zeros for a CPU chunk
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool

    @property
    def shareable(self) -> bool:
        """False for chunks other processes cannot open (CPU test mode)."""
        return bool(self.handle)


@dataclass(frozen=True, slots=True)
class IndexRecord:
    """One entry: which producer and chunk hold it, where, and the tensor it is."""

    producer_id: bytes  # 16 bytes, unique per producing process
    generation: int
    chunk: ChunkShare
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def encode_record(rec: IndexRecord) -> bytes:
    """The record's bytes (see the module docstring)."""
    c = rec.chunk
    name = rec.dtype.encode("ascii")
    head = _HEAD.pack(
        RECORD_MAGIC,
        RECORD_VERSION,
        len(name),
        len(rec.shape),
        int(c.event_sync_required),
        rec.producer_id,
        c.chunk_id,
        c.device_uuid,
        rec.generation,
        c.device,
        0,
        rec.offset,
        rec.nbytes,
        c.storage_size_bytes,
        c.storage_offset_bytes,
        c.ref_counter_offset,
        len(c.handle),
        len(c.ref_counter_handle),
        len(c.event_handle),
        0,
    )
    shape = struct.pack(f"<{len(rec.shape)}q", *rec.shape)
    return head + c.handle + c.ref_counter_handle + c.event_handle + name + shape


def decode_record(raw: bytes, key: str = "?") -> IndexRecord:
    """Parse a record; :class:`StoreCorrupt` naming the key for anything malformed."""
    if len(raw) < _HEAD.size:
        raise StoreCorrupt(f"cuda index record for {key!r} is truncated ({len(raw)} bytes)")
    (magic, version, name_len, ndim, sync, producer, chunk_id, device_uuid, gen, device, _pad,
     offset, nbytes, size_b, off_b, rc_off, h_len, rc_len, ev_len, _pad2) = _HEAD.unpack_from(
        raw, 0
    )  # fmt: skip
    if magic != RECORD_MAGIC:
        raise StoreCorrupt(f"cuda index record for {key!r} has bad magic {bytes(magic)!r}")
    if version != RECORD_VERSION:
        raise StoreCorrupt(f"cuda index record for {key!r} has unsupported version {version}")
    pos = _HEAD.size
    need = pos + h_len + rc_len + ev_len + name_len + 8 * ndim
    if len(raw) != need:
        raise StoreCorrupt(f"cuda index record for {key!r} is {len(raw)} bytes, expected {need}")
    handle = raw[pos : pos + h_len]
    pos += h_len
    rc_handle = raw[pos : pos + rc_len]
    pos += rc_len
    ev_handle = raw[pos : pos + ev_len]
    pos += ev_len
    dtype = raw[pos : pos + name_len].decode("ascii", "replace")
    pos += name_len
    shape = struct.unpack_from(f"<{ndim}q", raw, pos)
    try:
        expect = nbytes_of(dtype, list(shape))
    except CodecError as exc:
        raise StoreCorrupt(f"cuda index record for {key!r}: {exc}") from None
    if expect != nbytes or any(d < 0 for d in shape):
        raise StoreCorrupt(
            f"cuda index record for {key!r}: dtype {dtype} shape {list(shape)} needs {expect} "
            f"bytes, record says {nbytes}"
        )
    chunk = ChunkShare(
        bytes(chunk_id), device, bytes(device_uuid), bytes(handle), size_b, off_b,
        bytes(rc_handle), rc_off, bytes(ev_handle), bool(sync),
    )  # fmt: skip
    if chunk.shareable and offset + nbytes > size_b:
        raise StoreCorrupt(f"cuda index record for {key!r} points past its chunk")
    return IndexRecord(bytes(producer), gen, chunk, offset, nbytes, dtype, tuple(shape))


class FreeList:
    """First-fit allocator of :data:`SLOT_ALIGN`-aligned slots in a buffer of ``size`` bytes.

    Free ranges are kept sorted by offset and merged with their neighbours on free, so a buffer
    that empties is one range again. Pure bookkeeping: it never touches the memory.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0] if size else []
        self._ends: list[int] = [size] if size else []
        self.used = 0

    @staticmethod
    def rounded(nbytes: int) -> int:
        """The bytes a slot for ``nbytes`` takes."""
        return max(SLOT_ALIGN, nbytes + (-nbytes % SLOT_ALIGN))

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot for ``nbytes``, or None when no free range is big enough."""
        need = self.rounded(nbytes)
        for i, (start, end) in enumerate(zip(self._starts, self._ends, strict=True)):
            if end - start >= need:
                if end - start == need:
                    del self._starts[i], self._ends[i]
                else:
                    self._starts[i] = start + need
                self.used += need
                return start
        return None

    def free(self, offset: int, nbytes: int) -> None:
        """Return the slot at ``offset`` (as allocated for ``nbytes``)."""
        size = self.rounded(nbytes)
        end = offset + size
        i = bisect.bisect_left(self._starts, offset)
        if (i < len(self._starts) and self._starts[i] < end) or (i and self._ends[i - 1] > offset):
            raise ValueError(f"slot [{offset}, {end}) is already free (double free)")
        self.used -= size
        if i and self._ends[i - 1] == offset:  # merge with the range before
            i -= 1
            self._ends[i] = end
        else:
            self._starts.insert(i, offset)
            self._ends.insert(i, end)
        if i + 1 < len(self._starts) and self._starts[i + 1] == self._ends[i]:  # and after
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The free ranges, ``[start, end)``, in order (tests look at them)."""
        return list(zip(self._starts, self._ends, strict=True))
