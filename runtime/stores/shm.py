"""``shm://[name]``: a same-node store in ``/dev/shm/<name>/``, cross-process, zero-copy reads.

One file per key holding the blob described in :mod:`runtime.stores.base`. A put writes a
temporary file and ``os.replace``-s it onto the key's name, so readers see either the old value or
the new one, never a torn write; a reader ``mmap``-s the file and returns a tensor viewing the
mapping (no copy). A replaced or deleted file stays mapped until its last tensor is gone.

Mapping cache: a fresh mapping costs a page fault per few pages on first read (and an unmap
later), which caps a read at about memcpy/2. So each handle keeps its recent mappings and reuses
one while the key's file is the very same file: same device, inode, size, mtime and ctime. Writers
never modify a file in place (a put renames a new inode over the name), so an unchanged identity
means unchanged bytes; a replaced, deleted or expired file is mapped afresh or reported missing.
The cost: a cached mapping keeps its file's memory (and one file descriptor) alive after the file is
replaced or deleted, until the entry is evicted — least recently used beyond ``map_cache_bytes``
(default 256 MiB, 0 turns the cache off) or 64 entries, or unused for ``map_cache_idle_s``
(default 5 s; checked on the next get), ``delete`` through this handle, or ``close``.

TTL: the expiry is the file's mtime (a far-future sentinel for "never"); the header's
``expires_ms`` mirrors it for other readers of the layout. Reads, ``exists`` and the sweep (which
runs on put, at most every ``sweep_interval_s``) all judge expiry by the mtime, which ``stat``
returns whole: an expired value reads as missing.

``touch`` (a cache hit extending the TTL) works in place on the same inode: it sets the mtime
with ``futimens`` and rewrites the 8-byte header field with ``pwrite``; the tensor bytes are never
written. Why in place rather than a rewrite + rename like ``put``: a rewrite copies the whole value
on every cache hit, and would race a concurrent ``put`` or ``delete`` (renaming the old bytes back
over a newer value, or resurrecting a deleted key). In place is safe for readers: tensors handed
out view only the data bytes, which do not change; a cached mapping is keyed on the file's
identity, which includes mtime and ctime, so every handle re-reads the header after a touch; and
since expiry is judged by the mtime (set atomically), a reader that catches the header field
mid-``pwrite`` is never misled by it. The sweep and ``touch`` take an exclusive ``flock`` on the
file while they decide, so the sweep cannot unlink a file that a touch has just extended (both
re-check the mtime under the lock).

Readiness: Linux inotify on the directory (``IN_MOVED_TO``, which the rename produces), reached
through ``ctypes`` so no extra dependency is needed. One inotify descriptor per store handle sits in
the event loop (``add_reader``) and routes file names to waiting futures; ``wait`` registers its
futures after the watch exists and before it looks at the files, so no put can slip between. A
queue overflow wakes every waiter to re-check. tmpfs supports inotify; other platforms get a clear
:class:`StoreError` from ``wait``.

Query parameters: ``dir`` (base directory, default ``/dev/shm``), ``sweep_interval_s``,
``map_cache_bytes``, ``map_cache_idle_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import fcntl
import hashlib
import math
import mmap
import os
import re
import struct
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, urlsplit

from runtime.redis.waiters import KeyedWaiters, wait_present
from runtime.stores.base import (
    EXPIRES,
    EXPIRES_OFFSET,
    HEADER_MIN,
    MAGIC,
    VERSION,
    BlobHeader,
    EmbeddingStore,
    decode_header,
    encode_header,
    expiry_ms,
    tensor_from_blob,
    tensor_view,
)
from runtime.stores.errors import StoreCorrupt, StoreError, StoreKeyMissing, StoreTimeout

if TYPE_CHECKING:
    import torch

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TMP_PREFIX = ".tmp-"
_NEVER_NS = 2**62  # mtime of entries without a TTL (year ~2116): the sweep never touches them
_THREAD_WRITE_BYTES = 1 << 20  # larger writes go to a worker thread, off the event loop
_MAX_FILENAME = 200
_MAP_CACHE_ENTRIES = 64  # each cached mapping holds a file descriptor (mmap keeps a dup)

# inotify(7) constants
_IN_MOVED_TO = 0x00000080
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")


def key_filename(key: str) -> str:
    """The file name for a key: percent-encoded, or ``%H`` + sha256 when that is too long.

    A leading dot is escaped too, so no key can collide with the ``.tmp-`` files.
    """
    name = quote(key, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if not name or len(name) > _MAX_FILENAME:
        # "%H" is never produced by quote(), so hashed names cannot collide with encoded ones.
        name = "%H" + hashlib.sha256(key.encode()).hexdigest()
    return name


FileIdentity = tuple[int, int, int, int, int]


def _mtime_ns(exp_ms: int) -> int:
    """The mtime that encodes an expiry (epoch ms, 0 = never)."""
    return exp_ms * 1_000_000 if exp_ms else _NEVER_NS


def _expired(mtime_ns: int, now_ns: int | None = None) -> bool:
    """Whether a file with this mtime holds an expired value."""
    if mtime_ns >= _NEVER_NS:
        return False
    return (now_ns if now_ns is not None else time.time_ns()) >= mtime_ns


def _identity(st: os.stat_result) -> FileIdentity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(slots=True)
class _Mapped:
    """A cached mapping of one key's file, valid while the file keeps ``identity``."""

    identity: FileIdentity
    mm: mmap.mmap
    header: BlobHeader
    used: float


class _Inotify:
    """A non-blocking inotify descriptor watching one directory, wired into an event loop."""

    def __init__(
        self,
        directory: Path,
        on_names: Callable[[list[str]], None],
        on_overflow: Callable[[], None],
    ) -> None:
        libc_name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(libc_name, use_errno=True)
            init1, add_watch = libc.inotify_init1, libc.inotify_add_watch
        except (OSError, AttributeError) as exc:
            raise StoreError(f"shm store wait needs Linux inotify: {exc}") from exc
        add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise StoreError(f"inotify_init1 failed: {os.strerror(err)}")
        wd = add_watch(fd, os.fsencode(directory), _IN_MOVED_TO)
        if wd < 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise StoreError(f"inotify_add_watch({directory}) failed: {os.strerror(err)}")
        self.fd = fd
        self._on_names = on_names
        self._on_overflow = on_overflow
        self.loop = asyncio.get_running_loop()
        self.loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        names: list[str] = []
        overflow = False
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not buf:
                break
            pos = 0
            while pos + _EVENT.size <= len(buf):
                _wd, mask, _cookie, length = _EVENT.unpack_from(buf, pos)
                raw = buf[pos + _EVENT.size : pos + _EVENT.size + length]
                pos += _EVENT.size + length
                if mask & (_IN_Q_OVERFLOW | _IN_IGNORED):
                    overflow = True
                elif length:
                    names.append(os.fsdecode(raw.rstrip(b"\0")))
        if overflow:
            self._on_overflow()
        if names:
            self._on_names(names)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.fd)
        with contextlib.suppress(OSError):
            os.close(self.fd)


class ShmStore(EmbeddingStore):
    """Store in a shared-memory directory; see the module docstring."""

    def __init__(self, url: str = "shm://") -> None:
        parts = urlsplit(url)
        if parts.scheme != "shm":
            raise ValueError(f"not a shm:// URL: {url!r}")
        name = (parts.netloc + parts.path).strip("/") or "epd"
        if not _NAME_RE.match(name):
            raise ValueError(
                f"shm store name {name!r} must match {_NAME_RE.pattern} (one directory name)"
            )
        params = dict(parse_qsl(parts.query))
        self._url = url
        self.directory = Path(params.get("dir", "/dev/shm")) / name
        self.sweep_interval_s = float(params.get("sweep_interval_s", "5"))
        self.map_cache_bytes = int(params.get("map_cache_bytes", str(256 << 20)))
        self.map_cache_idle_s = float(params.get("map_cache_idle_s", "5"))
        self._maps: OrderedDict[str, _Mapped] = OrderedDict()
        self._mapped_bytes = 0
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._next_sweep = 0.0
        self._sweeping: asyncio.Task[int] | None = None
        self._inotify: _Inotify | None = None
        self._waiters: KeyedWaiters[str] = KeyedWaiters()
        """Futures of ``wait``, by file name (what inotify reports)."""
        self.wake_checks = 0
        """How many times ``wait`` re-examined its keys (tests use it to prove it does not spin)."""

    @property
    def url(self) -> str:
        return self._url

    def _path(self, key: str) -> Path:
        return self.directory / key_filename(key)

    # --- write ------------------------------------------------------------------------------

    def _write(self, key: str, header: bytes, data: memoryview, exp_ms: int) -> None:
        tmp = self.directory / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                if len(data):
                    f.write(data)
            mtime_ns = _mtime_ns(exp_ms)
            os.utime(tmp, ns=(mtime_ns, mtime_ns))
            os.replace(tmp, self._path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    async def put(self, key: str, tensor: torch.Tensor, ttl_s: float | None = None) -> None:
        exp = expiry_ms(ttl_s)
        header = encode_header(tensor, exp)
        data = tensor_view(tensor)
        if len(data) > _THREAD_WRITE_BYTES:
            await asyncio.to_thread(self._write, key, header, data, exp)
        else:
            self._write(key, header, data, exp)
        self._maybe_sweep()

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now < self._next_sweep or (self._sweeping and not self._sweeping.done()):
            return
        self._next_sweep = now + self.sweep_interval_s
        self._sweeping = asyncio.create_task(asyncio.to_thread(self.sweep))

    def sweep(self) -> int:
        """Delete expired files (and stale temp files); returns how many went. Blocking."""
        now_ns = time.time_ns()
        removed = 0
        with os.scandir(self.directory) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(_TMP_PREFIX):
                    # a writer died mid-put
                    if st.st_ctime_ns < now_ns - 3_600 * 10**9 and self._unlink_if_same(
                        entry.path, st.st_ino
                    ):
                        removed += 1
                elif _expired(st.st_mtime_ns, now_ns) and self._unlink_if_expired(
                    entry.path, st.st_ino
                ):
                    removed += 1
        return removed

    @staticmethod
    def _unlink_if_expired(path: str, ino: int) -> bool:
        # Under the file's lock (see touch), re-check that it is still the expired inode listed:
        # a touch may have extended it, or a put replaced it, since the directory was read.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            st = os.fstat(fd)
            if st.st_ino != ino or not _expired(st.st_mtime_ns):
                return False
            return ShmStore._unlink_if_same(path, ino)
        finally:
            os.close(fd)  # releases the lock

    @staticmethod
    def _unlink_if_same(path: str, ino: int) -> bool:
        # A put may have replaced the file since it was listed: only unlink the expired inode.
        try:
            if os.stat(path, follow_symlinks=False).st_ino != ino:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    # --- read -------------------------------------------------------------------------------

    def _map(self, key: str) -> tuple[mmap.mmap, BlobHeader]:
        name = key_filename(key)
        path = self.directory / name
        now = time.monotonic()
        self._evict_idle(now)
        try:
            identity = _identity(os.stat(path))
        except FileNotFoundError:
            self._forget(name)
            raise StoreKeyMissing(key) from None
        hit = self._maps.get(name)
        if hit is not None and hit.identity == identity:
            hit.used = now
            self._maps.move_to_end(name)
            mm, header = hit.mm, hit.header
        else:
            self._forget(name)
            try:
                with open(path, "rb") as f:
                    identity = _identity(os.fstat(f.fileno()))
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except FileNotFoundError:
                raise StoreKeyMissing(key) from None
            header = decode_header(mm, key)
            self._remember(name, _Mapped(identity, mm, header, now))
        if _expired(identity[3]):  # the mtime is the expiry (see the module docstring)
            self._forget(name)
            raise StoreKeyMissing(key)
        return mm, header

    # --- mapping cache (see the module docstring) ----------------------------------------------

    @property
    def cached_mappings(self) -> int:
        """How many mappings the cache holds now."""
        return len(self._maps)

    def _remember(self, name: str, entry: _Mapped) -> None:
        size = len(entry.mm)
        if size > self.map_cache_bytes:
            return
        self._maps[name] = entry
        self._mapped_bytes += size
        while self._mapped_bytes > self.map_cache_bytes or len(self._maps) > _MAP_CACHE_ENTRIES:
            _, old = self._maps.popitem(last=False)
            self._mapped_bytes -= len(old.mm)

    def _forget(self, name: str) -> None:
        # Never mm.close(): tensors handed out may still view it; the last reference unmaps.
        entry = self._maps.pop(name, None)
        if entry is not None:
            self._mapped_bytes -= len(entry.mm)

    def _evict_idle(self, now: float) -> None:
        while self._maps:
            name, oldest = next(iter(self._maps.items()))
            if now - oldest.used <= self.map_cache_idle_s:
                break
            self._forget(name)

    async def get(self, key: str) -> torch.Tensor:
        mm, header = self._map(key)
        return tensor_from_blob(mm, header)

    async def get_bytes(self, key: str) -> bytes:
        mm, header = self._map(key)
        return mm[header.data_offset :]

    def read_entry(self, key: str) -> tuple[bytes, float] | None:
        """The value's data bytes and the seconds until it expires (``inf``: never), or None
        when it is missing or expired. Blocking and cache-free (no mapping is kept), so it may
        run in a worker thread; meant for small values such as index records."""
        try:
            with open(self._path(key), "rb") as f:
                mtime_ns = os.fstat(f.fileno()).st_mtime_ns
                raw = f.read()
        except FileNotFoundError:
            return None
        now_ns = time.time_ns()
        if _expired(mtime_ns, now_ns):
            return None
        left = math.inf if mtime_ns >= _NEVER_NS else (mtime_ns - now_ns) / 1e9
        return raw[decode_header(raw, key).data_offset :], left

    def _live(self, key: str) -> bool:
        try:
            st = os.stat(self._path(key))
        except FileNotFoundError:
            return False
        return st.st_size >= HEADER_MIN and not _expired(st.st_mtime_ns)

    async def exists(self, key: str) -> bool:
        return self._live(key)

    def _touch_file(self, key: str, exp_ms: int) -> bool:
        """Extend the file under ``key`` in place (see the module docstring). Blocking, but a
        few syscalls on tmpfs; the lock is only ever held for as long by the sweep."""
        path = self._path(key)
        mtime_ns = _mtime_ns(exp_ms)
        for _ in range(3):  # a put may rename a new file over the name meanwhile: touch that one
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # the sweep decides under the same lock
                st = os.fstat(fd)
                if _expired(st.st_mtime_ns):
                    return False
                head = os.pread(fd, HEADER_MIN, 0)
                if len(head) < HEADER_MIN or head[:4] != MAGIC or head[4] != VERSION:
                    raise StoreCorrupt(f"store value for {key!r} is not an EPDT blob ({path})")
                os.pwrite(fd, EXPIRES.pack(exp_ms), EXPIRES_OFFSET)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            finally:
                os.close(fd)  # releases the lock
            try:
                if os.stat(path).st_ino == st.st_ino:
                    return True
            except FileNotFoundError:
                return False  # deleted (or swept) after we opened it
        return False

    async def touch(self, key: str, ttl_s: float | None) -> bool:
        exp = expiry_ms(ttl_s)
        ok = self._touch_file(key, exp)
        self._forget(key_filename(key))  # its identity changed; drop our entry early
        return ok

    async def delete(self, key: str) -> None:
        self._forget(key_filename(key))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    # --- readiness ----------------------------------------------------------------------------

    def _wake_names(self, names: list[str]) -> None:
        for name in names:
            self._waiters.wake(name)

    def _wake_all(self) -> None:
        self._waiters.wake_all()

    async def wait(self, keys: Sequence[str], timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        if not keys:
            return
        if self._inotify is None or self._inotify.loop is not loop:
            if self._inotify is not None:
                self._inotify.close()
            self._inotify = _Inotify(self.directory, self._wake_names, self._wake_all)
        key_of = {key_filename(k): k for k in keys}  # inotify reports file names

        async def missing(names: list[str]) -> list[str]:
            self.wake_checks += 1
            return [n for n in names if not self._live(key_of[n])]

        await wait_present(
            self._waiters,
            list(key_of),
            timeout_s,
            missing=missing,
            timed_out=lambda left: StoreTimeout([key_of[n] for n in left], timeout_s),
        )

    async def close(self) -> None:
        self._maps.clear()
        self._mapped_bytes = 0
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None
        if self._sweeping is not None:
            with contextlib.suppress(Exception):
                await self._sweeping
