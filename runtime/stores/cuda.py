"""``cuda://[name]``: embeddings stay in device memory; same process by reference to the producer's
buffer, other processes on the node through CUDA IPC.

Layout. Each producing process keeps a few large device buffers ("chunks", ``chunk_mb`` each,
at most ``max_mb`` in all for one store name and device, and at most ``device_max_mb`` for all
the store names of the process on one device) and places every entry in a slot of one
(:class:`FreeList`). Each chunk is shared ONCE, when it is created, with torch's public
``torch.multiprocessing.reductions.reduce_tensor``; its IPC fields go, field by field, into a
small record per entry (:mod:`runtime.stores.cuda_ipc`) that lives in a ``shm://`` index named
``<name>.cuda-index``. The index gives the store its cross-process lookup, TTL, ``touch`` and
``wait`` (inotify, no polling): exactly the shm store's semantics, because it *is* that store.

Why chunks instead of one IPC share per entry: torch counts IPC references per share and expects
one receiver per send. A store has any number of readers (or none), so per-entry shares would
either free memory a second reader still maps or never free it at all (the sent block waits in
torch's "limbo" for a receiver that never comes). The store decides itself when a slot's bytes
may be reused (below), so it settles torch's count for a chunk as soon as it shares it
(:func:`_settle_ipc_count`, the one private torch call, named there with its reason): a chunk
the producer drops is then freed like any tensor, whoever mapped it.

Reads. ``get`` reads the record, opens the chunk (with ``rebuild_cuda_tensor``, then kept open;
the producer's own process uses its buffer directly) and returns a device-to-device **copy** of
the entry, owned by the caller: a view into the chunk would be overwritten when the slot is
reused. The copy is microseconds for an embedding. The record names the producer's GPU by UUID,
and the reader opens it under its own index for that GPU (another ``CUDA_VISIBLE_DEVICES``
numbers the GPUs differently), in a worker thread (the IPC calls take milliseconds); a chunk
opened earlier at the same place of the same allocation (given back, its memory reused for the
new one) is dropped first, or torch's cache would hand out the old mapping. Opened chunks are
kept by producer and chunk, with the last few keys read from each producer; at most every
``sweep_interval_s`` a reading ``get`` (and every ``sweep``) checks those keys, newest first,
and unmaps each chunk none of them is still in the index under, then calls
``torch.cuda.ipc_collect()``. That check runs in a worker thread: the
look-ups are file reads, and torch synchronises the stream when it drops a mapped chunk. So the
chunks of an encode worker that exited, restarted or gave a chunk back do not stay mapped in
every reader. A chunk dropped while it still has entries the reader did not know of costs only
a reopen on the next read.

A reader that cannot open a chunk asks whether its producer still runs: each producing process
holds a shared ``flock`` on a file named by its id in ``<name>.cuda-live`` for its whole life.
Gone (no holder): the entry is lost with it and the key reads as missing (the pipeline then
re-encodes, as for any lost embedding). Still running: CUDA IPC itself does not work between
the two processes (containers without a shared IPC namespace, a driver or device that refuses
it), and :class:`StoreUnavailable` says so rather than passing every entry off as missing.

Lifetimes. A slot is freed ``grace_s`` (default 30 s) after its producer sees the entry gone
from the index (expired, deleted, or replaced by a newer put), not at once: a reader that found
the record just before it went still has ``grace_s`` to finish its copy. The producer keeps its
entries in a heap by expiry and re-checks only those that are due, on ``put`` (at most every
``sweep_interval_s``); an entry still there (its TTL extended by a ``touch``) is put back at its
new expiry. A put over an entry's key or a ``delete`` through this process retires it at once;
an entry deleted or overwritten by another process, or one without a TTL, is noticed by the
full check that runs whenever the chunks are full (off the event loop, in a worker thread). A
chunk that has held no entry for ``reclaim_s`` (default 30 s) is given back to torch's
allocator by the next sweep, so a burst does not keep its memory for the life of the process.

Writes: ``put`` copies the tensor into its slot and waits for that copy to finish before it
publishes the record, so a reader in another process (another CUDA stream) never sees a
half-written entry. The wait is on a blocking-sync CUDA event in a worker thread, which sleeps
rather than spinning a core. A put cancelled or failing after its copy was queued does not
free the slot while the copy may still run (another stream's put could be handed it): the slot
is retired behind the copy's event and freed by a sweep once that has completed.

CUDA is required: without it ``open_store("cuda://...")`` raises :class:`StoreError` naming the
alternatives. (Tests run the same logic on CPU memory through the ``device`` keyword; such a store
is readable only by its own process.)

Query parameters: ``device`` (CUDA index, default the current device), ``dir`` (the index's base
directory, default ``/dev/shm``), ``chunk_mb`` (256), ``max_mb`` (8192), ``device_max_mb``
(8192), ``grace_s`` (30), ``reclaim_s`` (30), ``sweep_interval_s`` (1).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import heapq
import itertools
import math
import os
import threading
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlencode, urlsplit

import torch

from runtime.stores.base import EmbeddingStore, expiry_ms, tensor_view
from runtime.stores.cuda_ipc import ChunkShare, FreeList, IndexRecord, decode_record, encode_record
from runtime.stores.errors import StoreCorrupt, StoreError, StoreKeyMissing, StoreUnavailable
from runtime.stores.shm import ShmStore
from schemas.tensors import dtype_name, torch_dtype

PRODUCER_ID = uuid.uuid4().bytes
"""This process's identity in index records (a record with it is read from our own chunks)."""
NO_DEVICE_UUID = bytes(16)
"""The device UUID of a CPU chunk (the test mode)."""
_NO_CHUNK = ChunkShare(bytes(16), -1, NO_DEVICE_UUID, b"", 0, 0, b"", 0, b"", False)
_MIB = 1 << 20
_INLINE_CHECKS = 32
"""Index look-ups a sweep does on the event loop; a bigger batch goes to a worker thread."""
_KEYS_PER_PRODUCER = 16
"""Keys remembered per foreign producer, to tell which of its chunks still hold entries."""
_PARAMS = frozenset(
    {"device", "dir", "chunk_mb", "max_mb", "device_max_mb", "grace_s", "reclaim_s",
     "sweep_interval_s"}
)  # fmt: skip


class Fence(Protocol):
    """What ``put`` needs of the event marking the end of its copy (a ``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(slots=True)
class _Chunk:
    share: ChunkShare
    buf: torch.Tensor  # uint8, the whole chunk
    slots: FreeList
    empty_since: float | None = None
    """When a sweep first saw it hold nothing (monotonic); None while it holds entries."""
    reclaimable: bool = True
    """False when torch's IPC count could not be settled: kept, since dropping it would only
    move it to torch's limbo (see :func:`_settle_ipc_count`)."""


@dataclass(slots=True)
class _Held:
    """A slot this process filled; freed ``grace_s`` after its record leaves the index."""

    chunk: _Chunk
    offset: int
    nbytes: int
    generation: int
    dropped_at: float | None = None
    due: float = math.inf
    """When the sweep next looks it up in the index (monotonic; its expiry); inf: only on a
    full check."""
    fence: Fence | None = None
    """The copy into the slot, on a device stream; the slot is not freed before it is done."""

    def copy_done(self) -> bool:
        return self.fence is None or self.fence.query()


@dataclass(slots=True)
class _Producer:
    """A process's device memory for one index (shared by every handle opened on it)."""

    device: torch.device
    chunk_bytes: int
    max_bytes: int
    live_dir: Path
    chunks: list[_Chunk] = field(default_factory=list)
    held: dict[str, _Held] = field(default_factory=dict)
    retired: list[_Held] = field(default_factory=list)
    generation: int = 0
    next_sweep: float = 0.0
    due: list[tuple[float, int, str, _Held]] = field(default_factory=list)
    """Heap of (due, tie-breaker, key, entry); items whose entry moved on are skipped."""
    seq: itertools.count[int] = field(default_factory=itertools.count)
    lookups: int = 0
    """Index look-ups the sweeps have done (tests count them)."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def reserved(self) -> int:
        return sum(c.slots.size for c in self.chunks)

    def alloc(self, nbytes: int) -> tuple[_Chunk, int] | None:
        with self.lock:
            for c in self.chunks:
                off = c.slots.alloc(nbytes)
                if off is not None:
                    c.empty_since = None
                    return c, off
        return None

    def grow(self, nbytes: int, device_max_bytes: int) -> tuple[_Chunk, int]:
        """A new chunk (a dedicated one for an entry bigger than ``chunk_bytes``), within both
        bounds: this store's ``max_mb`` and the process's ``device_max_mb`` on this device."""
        size = max(self.chunk_bytes, FreeList.rounded(nbytes))
        with self.lock:
            if self.reserved + size > self.max_bytes:
                raise StoreUnavailable(
                    f"cuda store is full: {self.reserved // _MIB} MiB of max_mb="
                    f"{self.max_bytes // _MIB} in use, {nbytes} more bytes wanted (entries are "
                    f"freed grace_s after they expire; raise max_mb or lower the TTL)"
                )
            _device_reserve(self.device, size, device_max_bytes, nbytes)
            try:
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                if buf.device.type == "cuda":
                    _announce_alive(self.live_dir)
                share, reclaimable = _share(buf)
                chunk = _Chunk(share, buf, FreeList(size), reclaimable=reclaimable)
            except BaseException:
                _device_reserve(self.device, -size, device_max_bytes, 0)
                raise
            self.chunks.append(chunk)
            _OWN_CHUNKS[chunk.share.chunk_id] = buf
            off = chunk.slots.alloc(nbytes)
            assert off is not None
            return chunk, off

    def free(self, h: _Held) -> None:
        with self.lock:
            h.chunk.slots.free(h.offset, h.nbytes)

    def abandon(self, h: _Held, now: float) -> None:
        """A put gave up on ``h`` before publishing it: free the slot now if its copy is done,
        else retire it behind the copy's fence (a sweep frees it once that has passed)."""
        with self.lock:
            if h.copy_done():
                h.chunk.slots.free(h.offset, h.nbytes)
            else:
                h.dropped_at = now
                self.retired.append(h)

    def hold(self, key: str, h: _Held, now: float, ttl_s: float | None) -> None:
        with self.lock:
            self.retire(key, now)
            self.held[key] = h
            self.schedule(key, h, now + (math.inf if ttl_s is None else ttl_s))

    def retire(self, key: str, now: float) -> None:
        """The entry held under ``key`` (if any) left the index: free it after grace. Locked."""
        old = self.held.pop(key, None)
        if old is not None:
            old.dropped_at = now
            self.retired.append(old)

    def schedule(self, key: str, h: _Held, due: float) -> None:
        """Look ``key`` up again at ``due`` (never, when inf); older heap items go stale. Locked."""
        h.due = due
        if due < math.inf:
            heapq.heappush(self.due, (due, next(self.seq), key, h))

    def pop_due(self, now: float) -> list[tuple[str, _Held]]:
        """The held entries due for a look-up by ``now``, off the heap. Locked."""
        out: list[tuple[str, _Held]] = []
        while self.due and self.due[0][0] <= now:
            due, _, key, h = heapq.heappop(self.due)
            if self.held.get(key) is h and h.due == due:  # else replaced, retired or rescheduled
                out.append((key, h))
        return out

    def free_retired(self, now: float, grace_s: float) -> int:
        """Free the retired slots whose grace has passed and whose copy is done. Locked."""
        keep: list[_Held] = []
        freed = 0
        for h in self.retired:
            assert h.dropped_at is not None
            if now - h.dropped_at >= grace_s and h.copy_done():
                h.chunk.slots.free(h.offset, h.nbytes)
                freed += 1
            else:
                keep.append(h)
        self.retired = keep
        return freed

    def release_empty(self, now: float, idle_s: float) -> list[_Chunk]:
        """Take out the chunks that have held nothing for ``idle_s``; the caller drops them
        (outside the lock). Torch's allocator gets the memory back; readers that mapped a
        chunk unmap it on their next sweep, and no record names it any more."""
        gone: list[_Chunk] = []
        with self.lock:
            for c in list(self.chunks):
                if c.slots.used or not c.reclaimable:
                    c.empty_since = None
                    continue
                c.empty_since = now if c.empty_since is None else c.empty_since
                if now - c.empty_since >= idle_s:
                    self.chunks.remove(c)
                    _OWN_CHUNKS.pop(c.share.chunk_id, None)
                    _device_reserve(self.device, -c.slots.size, 0, 0)
                    gone.append(c)
        return gone


@dataclass(slots=True)
class _Foreign:
    """Another process's chunks opened here, and the last keys read from them (newest last)."""

    chunks: dict[bytes, torch.Tensor] = field(default_factory=dict)
    places: dict[bytes, tuple[bytes, int]] = field(default_factory=dict)
    """Chunk id -> (IPC handle, offset in that allocation): where the chunk's memory lies."""
    keys: OrderedDict[str, bytes] = field(default_factory=OrderedDict)
    """Key -> the chunk it was read from."""
    reads: int = 0

    def pop(self, chunk_id: bytes) -> torch.Tensor:
        self.places.pop(chunk_id, None)
        return self.chunks.pop(chunk_id)


@dataclass(slots=True)
class _Opened:
    """The chunks this process opened on one index, by producer id (see the module docstring)."""

    producers: dict[bytes, _Foreign] = field(default_factory=dict)
    next_sweep: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def chunk(self, producer: bytes, chunk_id: bytes, key: str) -> torch.Tensor | None:
        """An opened chunk (None if not open), noting ``key`` as read from it."""
        with self.lock:
            f = self.producers.setdefault(producer, _Foreign())
            f.reads += 1
            f.keys[key] = chunk_id
            f.keys.move_to_end(key)
            while len(f.keys) > _KEYS_PER_PRODUCER:
                f.keys.popitem(last=False)
            return f.chunks.get(chunk_id)

    def add(self, producer: bytes, share: ChunkShare, buf: torch.Tensor) -> torch.Tensor:
        """Keep ``buf`` open (or the one another caller opened meanwhile) and return it."""
        with self.lock:
            f = self.producers.setdefault(producer, _Foreign())
            f.places[share.chunk_id] = (share.handle, share.storage_offset_bytes)
            return f.chunks.setdefault(share.chunk_id, buf)

    def pop_aliases(self, producer: bytes, share: ChunkShare) -> list[torch.Tensor]:
        """Take out the other chunks of ``producer`` opened at the same place as ``share``:
        the producer gave them back and torch put the new chunk in their memory. Left open,
        torch's receiver cache would hand the new chunk the old mapping, at the old size."""
        place = (share.handle, share.storage_offset_bytes)
        with self.lock:
            f = self.producers.get(producer)
            if f is None:
                return []
            stale = [c for c, at in f.places.items() if at == place and c != share.chunk_id]
            return [f.pop(c) for c in stale]

    def sweep(self, references: Callable[[str, bytes, bytes], bool]) -> int:
        """Drop (unmap) every opened chunk none of whose remembered keys the index still holds
        in it (``references(key, producer, chunk_id)``, asked newest key first, until each
        chunk has an answer yes); returns how many chunks went. Blocking: run it in a worker
        thread, where the dropped chunks' last references go (torch syncs the stream then)."""
        with self.lock:
            known = [(p, f, f.reads, list(f.keys.items()), set(f.chunks)) for p, f in
                     self.producers.items()]  # fmt: skip
        verdicts = [(p, f, reads, _dead_chunks(p, keys, chunks, references))
                    for p, f, reads, keys, chunks in known]  # fmt: skip
        released: list[torch.Tensor] = []
        with self.lock:
            for producer, f, reads, dead in verdicts:
                if self.producers.get(producer) is not f or f.reads != reads:
                    continue  # read since the snapshot: judged again next time
                released += [f.pop(c) for c in dead]
                if not f.chunks:
                    del self.producers[producer]
        count = len(released)
        released.clear()  # the last references: unmapped here, off the event loop
        if count and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # let CUDA release what the dropped tensors mapped
        return count


def _dead_chunks(
    producer: bytes,
    keys: list[tuple[str, bytes]],
    chunks: set[bytes],
    references: Callable[[str, bytes, bytes], bool],
) -> set[bytes]:
    """Of ``chunks``, those no remembered key (asked newest first) is still indexed in."""
    live: set[bytes] = set()
    for key, chunk_id in reversed(keys):
        if live == chunks:
            break
        if chunk_id in chunks and chunk_id not in live and references(key, producer, chunk_id):
            live.add(chunk_id)
    return chunks - live


_PRODUCERS: dict[tuple[str, str], _Producer] = {}
_OWN_CHUNKS: dict[bytes, torch.Tensor] = {}
_OPENED: dict[str, _Opened] = {}
"""Chunks of other processes this process has opened, per index directory."""
_DEVICE_RESERVED: dict[str, int] = {}
"""Bytes of chunks this process holds per device, over every store name."""
_LIVE_FDS: dict[str, int] = {}
"""Liveness directory -> the descriptor holding this process's shared lock in it."""
_REGISTRY_LOCK = threading.Lock()


def _device_reserve(device: torch.device, delta: int, limit: int, wanted: int) -> None:
    """Count ``delta`` bytes of chunks on ``device``; a growth past ``limit`` is refused."""
    with _REGISTRY_LOCK:
        now = _DEVICE_RESERVED.get(str(device), 0)
        if delta > 0 and now + delta > limit:
            raise StoreUnavailable(
                f"cuda stores of this process hold {now // _MIB} MiB on {device}, at "
                f"device_max_mb={limit // _MIB}; {wanted} more bytes wanted (empty chunks go "
                f"back reclaim_s after their last entry; raise device_max_mb or lower the TTL)"
            )
        _DEVICE_RESERVED[str(device)] = now + delta


def _settle_ipc_count(ref_counter_handle: bytes, ref_counter_offset: int) -> bool:
    """Give back, at once, the one receiver reference torch counts for a share just made.

    The one private torch call of this store, kept here. Why: torch frees a shared CUDA block
    only once the share's cross-process counter is back at 0, and it expects one receiver per
    share to bring it there. A chunk has any number of readers, or none (then the block would
    sit in torch's limbo for ever). The store decides itself when a slot may be reused (grace_s
    after its entry left the index), so it settles the count now, with the call torch's own
    ``rebuild_cuda_tensor`` makes for a share it already holds; readers' releases only take the
    counter below 0, which torch treats as free. No public API does this. Returns False when
    the call fails (a torch change): that chunk is then kept for the life of the process, as
    every chunk was before, rather than dropped into the limbo.
    """
    try:
        release = torch.UntypedStorage._release_ipc_counter  # type: ignore[attr-defined]
        release(ref_counter_handle, ref_counter_offset)
    except (AttributeError, TypeError, RuntimeError) as exc:
        warnings.warn(f"cuda store: chunks cannot be given back ({exc!r})", stacklevel=2)
        return False
    return True


def _device_uuid(device: torch.device) -> bytes:
    """The 16-byte UUID of a CUDA device (stable across processes, unlike its index)."""
    props: Any = torch.cuda.get_device_properties(device)  # torch's stubs call .uuid a str
    return bytes(props.uuid.bytes)


def _local_index(device_uuid: bytes, producer_index: int) -> int:
    """This process's index of the GPU with ``device_uuid``; StoreUnavailable when it cannot
    see that GPU (``CUDA_VISIBLE_DEVICES`` hides it)."""
    for i in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", i)) == device_uuid:
            return i
    raise StoreUnavailable(
        f"cuda store: the entry lives on GPU-{uuid.UUID(bytes=device_uuid)} (device "
        f"{producer_index} of its producer), which this process does not see "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); give "
        f"readers and producers the same GPUs"
    )


def _share(buf: torch.Tensor) -> tuple[ChunkShare, bool]:
    """Share a chunk once through torch's public reductions (CPU chunks are not shareable);
    and whether it may be given back later (torch's IPC count settled)."""
    chunk_id = uuid.uuid4().bytes
    if buf.device.type != "cuda":
        share = ChunkShare(chunk_id, -1, NO_DEVICE_UUID, b"", buf.numel(), 0, b"", 0, b"", False)
        return share, True
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    rebuild, args = reduce_tensor(buf)
    if rebuild is not rebuild_cuda_tensor:  # pragma: no cover - a torch change we must notice
        raise StoreError(f"torch shares CUDA tensors through {rebuild!r}, not rebuild_cuda_tensor")
    (_cls, _size, _stride, _offset, _storage_cls, _dtype, device, handle, size_b, off_b,
     _grad, rc_handle, rc_off, ev_handle, ev_sync) = args  # fmt: skip
    settled = _settle_ipc_count(bytes(rc_handle), int(rc_off)) if rc_handle else True
    share = ChunkShare(
        chunk_id, int(device), _device_uuid(buf.device), bytes(handle), int(size_b), int(off_b),
        bytes(rc_handle or b""), int(rc_off), bytes(ev_handle or b""), bool(ev_sync),
    )  # fmt: skip
    return share, settled


def _open(share: ChunkShare) -> torch.Tensor:
    """Another process's chunk as a uint8 tensor on our index of its GPU (mapped until the last
    reference goes)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = _local_index(share.device_uuid, share.device)
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size([share.storage_size_bytes]), (1,), 0, torch.UntypedStorage,
        torch.uint8, device, share.handle, share.storage_size_bytes,
        share.storage_offset_bytes, False, share.ref_counter_handle, share.ref_counter_offset,
        share.event_handle, share.event_sync_required,
    )  # fmt: skip


def _copy_fence(device: torch.device) -> Fence | None:
    """An event marking the end of the copy just queued on ``device``'s current stream (None
    on the CPU, where the copy is already done). Blocking-sync, so a thread waiting on it
    sleeps instead of spinning a core."""
    if device.type != "cuda":
        return None
    done = torch.cuda.Event(blocking=True)
    done.record(torch.cuda.current_stream(device))
    return done


def _announce_alive(live_dir: Path) -> None:
    """Hold a shared lock on ``<live_dir>/<our producer id>`` until the process ends (readers
    tell a producer that is gone from broken IPC by it; see the module docstring)."""
    with _REGISTRY_LOCK:
        if str(live_dir) in _LIVE_FDS:
            return
        live_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd = os.open(live_dir / PRODUCER_ID.hex(), flags, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        _LIVE_FDS[str(live_dir)] = fd


def producer_alive(live_dir: Path, producer: bytes) -> bool:
    """Whether the process with id ``producer`` still holds its liveness lock in ``live_dir``.
    A file nobody holds belongs to a process that ended: it is removed."""
    path = live_dir / producer.hex()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return False
    finally:
        os.close(fd)


def _resolve_device(spec: str | None, override: torch.device | None) -> torch.device:
    if override is not None:
        return override
    if not torch.cuda.is_available():
        raise StoreError(
            "cuda:// embedding stores need CUDA, and torch.cuda.is_available() is False here "
            f"(torch {torch.__version__}); use shm:// (same node) or redis:// instead"
        )
    index = int(spec) if spec not in (None, "") else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise StoreError(f"cuda:// device={index}: this node has {torch.cuda.device_count()}")
    return torch.device("cuda", index)


class CudaStore(EmbeddingStore):
    """Device-memory store with a shm index; see the module docstring.

    ``device``: tests only — run the store on another device (CPU) without CUDA.
    """

    def __init__(self, url: str = "cuda://", *, device: torch.device | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "cuda":
            raise ValueError(f"not a cuda:// URL: {url!r}")
        name = (parts.netloc + parts.path).strip("/") or "epd"
        params = dict(parse_qsl(parts.query))
        unknown = set(params) - _PARAMS
        if unknown:
            raise ValueError(f"cuda:// URL {url!r}: unknown parameter(s) {sorted(unknown)}")
        self._url = url
        self.device = _resolve_device(params.get("device"), device)
        self.grace_s = float(params.get("grace_s", "30"))
        self.reclaim_s = float(params.get("reclaim_s", "30"))
        self.sweep_interval_s = float(params.get("sweep_interval_s", "1"))
        chunk_bytes = int(float(params.get("chunk_mb", "256")) * _MIB)
        max_bytes = int(float(params.get("max_mb", "8192")) * _MIB)
        self.device_max_bytes = int(float(params.get("device_max_mb", "8192")) * _MIB)
        if chunk_bytes <= 0 or max_bytes < chunk_bytes or self.grace_s < 0:
            raise ValueError(f"cuda:// URL {url!r}: need 0 < chunk_mb <= max_mb and grace_s >= 0")
        if self.device_max_bytes < chunk_bytes or self.reclaim_s < 0:
            raise ValueError(f"cuda:// URL {url!r}: need chunk_mb <= device_max_mb, reclaim_s >= 0")
        index_q: dict[str, str] = {k: params[k] for k in ("dir", "sweep_interval_s") if k in params}
        index_url = f"shm://{name}.cuda-index" + (f"?{urlencode(index_q)}" if index_q else "")
        self._index = ShmStore(index_url)
        self._live_dir = self._index.directory.with_name(f"{name}.cuda-live")
        key = (str(self._index.directory), str(self.device))
        with _REGISTRY_LOCK:
            prod = _PRODUCERS.get(key)
            if prod is None:
                prod = _Producer(self.device, chunk_bytes, max_bytes, self._live_dir)
                _PRODUCERS[key] = prod
            opened = _OPENED.setdefault(key[0], _Opened())
        self._producer = prod
        self._opened = opened

    @property
    def url(self) -> str:
        return self._url

    @property
    def wake_checks(self) -> int:
        """How many times ``wait`` re-examined its keys (the index's count)."""
        return self._index.wake_checks

    # --- write ------------------------------------------------------------------------------

    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        expiry_ms(ttl_s)  # validates the TTL before any memory is taken
        t = tensor.detach()
        dtype = dtype_name(t.dtype)
        nbytes = t.numel() * t.element_size()
        prod = self._producer
        held: _Held | None = None
        share = _NO_CHUNK
        offset = 0
        if nbytes:
            chunk, offset = await self._place(nbytes)
            with prod.lock:
                prod.generation += 1
                held = _Held(chunk, offset, nbytes, prod.generation)
            share = chunk.share
            try:
                await self._copy_in(held, t)
            except BaseException:
                prod.abandon(held, time.monotonic())
                raise
        generation = held.generation if held else 0
        rec = IndexRecord(PRODUCER_ID, generation, share, offset, nbytes, dtype, tuple(t.shape))
        try:
            await self._index.put_bytes(key, encode_record(rec), ttl_s)
        except BaseException:
            if held is not None:
                prod.abandon(held, time.monotonic())
            raise
        if held is not None:
            prod.hold(key, held, time.monotonic(), ttl_s)

    async def _place(self, nbytes: int) -> tuple[_Chunk, int]:
        prod = self._producer
        if time.monotonic() >= prod.next_sweep:
            await self.sweep()
        slot = prod.alloc(nbytes)
        if slot is None:
            # Free what has gone before growing, but keep empty chunks: this entry wants one.
            await self.sweep(full=True, reclaim=False)
            slot = prod.alloc(nbytes) or self._grow(nbytes)
        return slot

    def _grow(self, nbytes: int) -> tuple[_Chunk, int]:
        prod = self._producer
        try:
            return prod.grow(nbytes, self.device_max_bytes)
        except StoreUnavailable:
            # Too big for every empty chunk (a dedicated one): give those back, then try again.
            if not prod.release_empty(time.monotonic(), 0.0):
                raise
            return prod.grow(nbytes, self.device_max_bytes)

    async def _copy_in(self, h: _Held, t: torch.Tensor) -> None:
        """Copy ``t`` into the slot; return once the bytes are there (readers in other processes
        use other streams, so only finished bytes may be published)."""
        src = t.contiguous().reshape(-1).view(torch.uint8)
        dst = h.chunk.buf.narrow(0, h.offset, h.nbytes)
        dst.copy_(src, non_blocking=True)
        h.fence = _copy_fence(dst.device)
        if h.fence is not None and not h.fence.query():
            await asyncio.to_thread(h.fence.synchronize)

    async def sweep(self, *, full: bool = False, reclaim: bool = True) -> int:
        """Free the slots whose entries left the index ``grace_s`` ago; returns how many.

        Looks up in the index only the entries that are due (their expiry has come), or every
        held entry when ``full``; gives back chunks empty for ``reclaim_s`` (unless not
        ``reclaim``); also drops foreign chunks no longer referenced (see the module
        docstring)."""
        prod = self._producer
        now = time.monotonic()
        prod.next_sweep = now + self.sweep_interval_s
        await self._sweep_opened(now)
        with prod.lock:
            batch = list(prod.held.items()) if full else prod.pop_due(now)
            prod.lookups += len(batch)
        try:
            if len(batch) <= _INLINE_CHECKS:
                left = [self._left(key, h) for key, h in batch]
            else:  # many look-ups: keep them off the event loop
                left = await asyncio.to_thread(lambda: [self._left(k, h) for k, h in batch])
        except BaseException:
            with prod.lock:  # cancelled or failed: look the popped entries up next time
                for key, h in batch:
                    if prod.held.get(key) is h and not full:
                        prod.schedule(key, h, now)
            raise
        with prod.lock:
            for (key, h), secs in zip(batch, left, strict=True):
                if prod.held.get(key) is not h:
                    continue  # replaced or deleted through this process meanwhile
                if secs is None:
                    prod.retire(key, now)
                elif not full:
                    prod.schedule(key, h, now + secs)  # a touch extended it: look again then
            freed = prod.free_retired(now, self.grace_s)
        if reclaim:
            prod.release_empty(now, self.reclaim_s)  # dropped here: torch frees them
        return freed

    def _left(self, key: str, h: _Held) -> float | None:
        """Seconds until our entry ``h`` under ``key`` expires (inf: never), or None when the
        index no longer holds it. Blocking (a small file read); thread-safe."""
        rec = self._indexed(key)
        if rec is None or rec[0].producer_id != PRODUCER_ID or rec[0].generation != h.generation:
            return None
        return rec[1]

    def _indexed(self, key: str) -> tuple[IndexRecord, float] | None:
        """The record under ``key`` and its seconds left, or None (missing, expired, corrupt)."""
        try:
            entry = self._index.read_entry(key)
            return None if entry is None else (decode_record(entry[0], key), entry[1])
        except StoreCorrupt:
            return None

    def _references(self, key: str, producer: bytes, chunk_id: bytes) -> bool:
        rec = self._indexed(key)
        return rec is not None and (rec[0].producer_id, rec[0].chunk.chunk_id) == (
            producer,
            chunk_id,
        )

    async def _sweep_opened(self, now: float) -> int:
        """Drop foreign chunks no live record references (at most every sweep_interval_s), in
        a worker thread: its look-ups read files, and torch syncs the stream as it unmaps."""
        opened = self._opened
        if now < opened.next_sweep or not opened.producers:
            return 0
        opened.next_sweep = now + self.sweep_interval_s
        return await asyncio.to_thread(opened.sweep, self._references)

    # --- read -------------------------------------------------------------------------------

    async def _record(self, key: str) -> IndexRecord:
        return decode_record(await self._index.get_bytes(key), key)

    async def _chunk_of(self, rec: IndexRecord, key: str) -> torch.Tensor:
        if rec.producer_id == PRODUCER_ID:
            buf = _OWN_CHUNKS.get(rec.chunk.chunk_id)
            if buf is None:  # given back after its last entry went: this record is stale
                raise StoreKeyMissing(key)
            return buf
        if not rec.chunk.shareable:
            raise StoreError(f"{key!r} lives in another process's CPU-only cuda:// test store")
        buf = self._opened.chunk(rec.producer_id, rec.chunk.chunk_id, key)
        if buf is not None:
            return buf
        # Mapping a chunk takes CUDA IPC calls (and dropping an alias a stream sync): off the loop.
        return await asyncio.to_thread(self._open_foreign, rec, key)

    def _open_foreign(self, rec: IndexRecord, key: str) -> torch.Tensor:
        """Open another process's chunk and keep it open; blocking (see :meth:`_chunk_of`)."""
        stale = self._opened.pop_aliases(rec.producer_id, rec.chunk)
        stale.clear()  # unmapped here, before torch's cache could hand the old mapping out
        try:
            buf = _open(rec.chunk)
        except RuntimeError as exc:  # the producer is gone, or IPC does not work between us
            if producer_alive(self._live_dir, rec.producer_id):
                raise StoreUnavailable(
                    f"cuda store: cannot open the chunk holding {key!r} through CUDA IPC although "
                    f"its producer is running ({exc}); CUDA IPC does not work between these "
                    f"processes (containers need a shared IPC namespace and the same GPU; some "
                    f"drivers and devices refuse IPC): use shm:// or redis:// between them"
                ) from exc
            raise StoreKeyMissing(key) from None  # the entry went with its producer
        return self._opened.add(rec.producer_id, rec.chunk, buf)

    async def get(self, key: str) -> torch.Tensor:
        rec = await self._record(key)
        dt = torch_dtype(rec.dtype)
        if rec.nbytes == 0:
            return torch.empty(rec.shape, dtype=dt, device=self.device)
        if rec.producer_id != PRODUCER_ID:
            await self._sweep_opened(time.monotonic())
        buf = await self._chunk_of(rec, key)
        out = buf.narrow(0, rec.offset, rec.nbytes).clone()
        return out.view(dt).view(rec.shape)

    async def get_bytes(self, key: str) -> bytes:
        return bytes(tensor_view(await self.get(key)))

    async def exists(self, key: str) -> bool:
        return await self._index.exists(key)

    async def touch(self, key: str, ttl_s: float | None) -> bool:
        ok = await self._index.touch(key, ttl_s)
        prod = self._producer
        with prod.lock:
            h = prod.held.get(key)
            if ok and h is not None:  # look it up at its new expiry instead
                prod.schedule(key, h, time.monotonic() + (math.inf if ttl_s is None else ttl_s))
        return ok

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        await self._index.wait(keys, timeout_s)

    async def delete(self, key: str) -> None:
        await self._index.delete(key)
        with self._producer.lock:  # our entry under key (if any) is gone: freed after grace_s
            self._producer.retire(key, time.monotonic())

    def stats(self) -> dict[str, int]:
        """This process's device memory for the store: chunks, reserved/used bytes, entries, and
        what the process holds on the device over every store name."""
        prod = self._producer
        with prod.lock:
            out = {
                "chunks": len(prod.chunks),
                "reserved_bytes": prod.reserved,
                "used_bytes": sum(c.slots.used for c in prod.chunks),
                "held": len(prod.held),
                "retired": len(prod.retired),
            }
        with self._opened.lock:
            out["opened_producers"] = len(self._opened.producers)
            out["opened_chunks"] = sum(len(f.chunks) for f in self._opened.producers.values())
        with _REGISTRY_LOCK:
            out["device_reserved_bytes"] = _DEVICE_RESERVED.get(str(self.device), 0)
        return out

    async def close(self) -> None:
        """Close the index handle. The device memory belongs to the process (other handles on
        the same name share it) and entries live out their TTL."""
        await self._index.close()
