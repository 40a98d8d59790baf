"""``cuda://`` beyond the shared store suite (tests/unit/test_stores.py runs that on it too).

On CPU: the index record codec, the slot allocator, URL parsing, the refusal without CUDA, and
slot lifetimes (grace, overwrite, full) through the store's test-only CPU mode. With CUDA: the
real thing, in one process and across two through CUDA IPC.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import shutil
import sys
import textwrap
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing.reductions as reductions

import runtime.stores.cuda as cuda_mod
from runtime.stores import StoreCorrupt, StoreError, StoreKeyMissing, StoreUnavailable, open_store
from runtime.stores.cuda import PRODUCER_ID, CudaStore
from runtime.stores.cuda_ipc import (
    SLOT_ALIGN,
    ChunkShare,
    FreeList,
    IndexRecord,
    decode_record,
    encode_record,
)

REPO_ROOT = str(Path(__file__).resolve().parents[2])
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _record(**kw: object) -> IndexRecord:
    share = ChunkShare(
        b"c" * 16, 0, b"u" * 16, b"h" * 64, 1 << 20, 512, b"/torch_1_2", 3, b"e" * 64, True
    )
    base: dict[str, object] = {
        "producer_id": b"p" * 16,
        "generation": 7,
        "chunk": share,
        "offset": 4096,
        "nbytes": 1369 * 1536 * 2,
        "dtype": "bfloat16",
        "shape": (1369, 1536),
    }
    return IndexRecord(**{**base, **kw})  # type: ignore[arg-type]


def test_record_round_trip_and_corruption() -> None:
    rec = _record(offset=0, nbytes=2 * 3 * 4, dtype="float32", shape=(2, 3))
    raw = encode_record(rec)
    assert decode_record(raw, "k") == rec
    scalar = _record(offset=0, nbytes=8, dtype="int64", shape=())
    assert decode_record(encode_record(scalar)) == scalar
    with pytest.raises(StoreCorrupt, match=r"'k'.*truncated"):
        decode_record(raw[:10], "k")
    with pytest.raises(StoreCorrupt, match="bad magic"):
        decode_record(b"XXXX" + raw[4:], "k")
    with pytest.raises(StoreCorrupt, match="expected"):
        decode_record(raw + b"\0", "k")
    with pytest.raises(StoreCorrupt, match="needs 24 bytes"):
        decode_record(encode_record(_record(offset=0, nbytes=23, dtype="float32", shape=(2, 3))))
    with pytest.raises(StoreCorrupt, match="past its chunk"):
        decode_record(encode_record(_record(offset=(1 << 20) - 8)))
    with pytest.raises(StoreCorrupt, match="unsupported version 1"):  # no device UUID in it
        decode_record(raw[:4] + b"\x01" + raw[5:], "k")


def test_free_list_first_fit_and_merging() -> None:
    fl = FreeList(4 * SLOT_ALIGN)
    a = fl.alloc(1)  # rounds up to one slot
    b = fl.alloc(SLOT_ALIGN + 1)  # two slots
    c = fl.alloc(SLOT_ALIGN)
    assert (a, b, c) == (0, SLOT_ALIGN, 3 * SLOT_ALIGN)
    assert a is not None and b is not None and c is not None
    assert fl.alloc(1) is None and fl.used == fl.size
    fl.free(b, SLOT_ALIGN + 1)
    assert fl.alloc(3 * SLOT_ALIGN) is None  # only two free slots, and not where a/c sit
    fl.free(a, 1)
    assert fl.ranges == [(0, 3 * SLOT_ALIGN)]  # merged with the range after
    fl.free(c, SLOT_ALIGN)
    assert fl.ranges == [(0, 4 * SLOT_ALIGN)] and fl.used == 0  # and with the one before
    with pytest.raises(ValueError, match="double free"):
        fl.free(0, 1)


def test_url_parsing_and_refusal_without_cuda() -> None:
    with pytest.raises(ValueError, match="unknown parameter"):
        CudaStore("cuda://x?chunk=1", device=CPU)
    with pytest.raises(ValueError, match="chunk_mb <= max_mb"):
        CudaStore("cuda://x?chunk_mb=8&max_mb=4", device=CPU)
    with pytest.raises(ValueError, match="shm store name"):
        CudaStore("cuda://../etc", device=CPU)
    if not torch.cuda.is_available():
        with pytest.raises(StoreError, match=r"need CUDA.*torch\.cuda\.is_available\(\) is False"):
            open_store("cuda://epd")


@pytest.fixture
async def cpu_store() -> AsyncIterator[CudaStore]:
    tag = uuid.uuid4().hex[:12]
    store = CudaStore(f"cuda://epd-test-{tag}?chunk_mb=1&max_mb=2&grace_s=0", device=CPU)
    try:
        yield store
    finally:
        await store.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)


async def test_index_holds_explicit_records(cpu_store: CudaStore) -> None:
    t = torch.arange(10, dtype=torch.float32)
    await cpu_store.put("k", t, ttl_s=60)
    rec = decode_record(await cpu_store._index.get_bytes("k"), "k")
    assert rec.producer_id == PRODUCER_ID and rec.shape == (10,) and rec.dtype == "float32"
    assert rec.offset % SLOT_ALIGN == 0 and rec.nbytes == 40
    assert not rec.chunk.shareable  # CPU memory: no IPC handle


async def test_slots_are_freed_after_expiry_delete_and_overwrite(cpu_store: CudaStore) -> None:
    mib = torch.zeros(1 << 18, dtype=torch.float32)  # 1 MiB: one whole chunk
    # Long enough that "a" is still live at the "full" put below on a loaded machine (a CI
    # host running the suite on every core can stall this task for a good part of a second).
    await cpu_store.put("a", mib, ttl_s=2.0)
    await cpu_store.put("b", mib)
    assert cpu_store.stats()["chunks"] == 2
    with pytest.raises(StoreUnavailable, match="full"):  # max_mb=2, and both are live
        await cpu_store.put("c", mib)
    for _ in range(400):  # observe the expiry (not a timing assertion)
        if not await cpu_store.exists("a"):
            break
        await asyncio.sleep(0.025)
    await cpu_store.put("c", mib)  # the full store sweeps: a's slot is reused
    assert cpu_store.stats() | {"reserved_bytes": 0, "device_reserved_bytes": 0} == {
        "chunks": 2, "reserved_bytes": 0, "used_bytes": 2 << 20, "held": 2, "retired": 0,
        "opened_producers": 0, "opened_chunks": 0, "device_reserved_bytes": 0,
    }  # fmt: skip
    await cpu_store.delete("c")
    await cpu_store.put("b", torch.ones(4))  # in c's freed slot; b's old one is retired...
    assert cpu_store.stats()["retired"] == 1
    assert await cpu_store.sweep() == 1  # ...and freed by the next sweep
    assert cpu_store.stats()["used_bytes"] == SLOT_ALIGN
    assert torch.equal(await cpu_store.get("b"), torch.ones(4))
    with pytest.raises(StoreKeyMissing):
        await cpu_store.get("c")


async def test_grace_keeps_a_dropped_slot() -> None:
    tag = uuid.uuid4().hex[:12]
    store = CudaStore(f"cuda://epd-test-{tag}?chunk_mb=1&grace_s=600", device=CPU)
    try:
        await store.put("k", torch.ones(8))
        await store.delete("k")
        assert await store.sweep() == 0  # a reader may still be copying: not reused yet
        assert store.stats()["retired"] == 1 and store.stats()["used_bytes"] == SLOT_ALIGN
    finally:
        await store.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)


async def test_got_tensors_are_copies(cpu_store: CudaStore) -> None:
    await cpu_store.put("k", torch.ones(4))
    got = await cpu_store.get("k")
    got.zero_()
    assert torch.equal(await cpu_store.get("k"), torch.ones(4))


# --- sweeps look up only what is due -----------------------------------------------------------


@pytest.fixture
async def counted_store(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[CudaStore, list[str]]]:
    """A CPU-mode store (no sweep on put after the first) and the keys its index is asked for."""
    tag = uuid.uuid4().hex[:12]
    store = CudaStore(
        f"cuda://epd-test-{tag}?chunk_mb=1&grace_s=0&sweep_interval_s=3600", device=CPU
    )
    asked: list[str] = []
    read_entry = store._index.read_entry

    def counting(key: str) -> object:
        asked.append(key)
        return read_entry(key)

    monkeypatch.setattr(store._index, "read_entry", counting)
    try:
        yield store, asked
    finally:
        await store.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)


async def _until_due(store: CudaStore, keys: list[str]) -> None:
    """Wait (bounded) until ``keys`` have expired in the index and their look-ups are due."""
    due = max(store._producer.held[k].due for k in keys)
    for _ in range(400):
        if time.monotonic() >= due and not any([await store.exists(k) for k in keys]):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{keys} did not expire")


async def test_sweep_looks_up_only_the_due_entries(
    counted_store: tuple[CudaStore, list[str]],
) -> None:
    store, asked = counted_store
    for i in range(2000):
        await store.put(f"long-{i}", torch.ones(4), ttl_s=600)
    short = [f"short-{i}" for i in range(20)]
    for k in short:
        await store.put(k, torch.ones(4), ttl_s=0.05)
    forever = [f"forever-{i}" for i in range(3)]
    for k in forever:
        await store.put(k, torch.ones(4))
    await _until_due(store, short)
    asked.clear()
    assert await store.sweep() == 20  # grace_s=0: freed at once
    assert sorted(asked) == sorted(short)  # not one of the 2003 live entries was looked up
    assert store.stats()["held"] == 2003
    asked.clear()
    assert await store.sweep() == 0 and asked == []  # nothing due any more
    # The full check (run when the chunks are full, in a worker thread) looks at everything,
    # and finds a no-TTL entry another process deleted.
    await store._index.delete("forever-0")
    assert await store.sweep(full=True) == 1
    assert len(asked) == 2003 and store.stats()["held"] == 2002


async def test_sweep_follows_touches(counted_store: tuple[CudaStore, list[str]]) -> None:
    store, asked = counted_store
    # The TTL outlasts any stall between the puts and the touches on a loaded host: a touch
    # that came after the expiry would find nothing to extend.
    for k in ("mine", "theirs", "gone"):
        await store.put(k, torch.ones(4), ttl_s=1.0)
    await store.touch("mine", 600)  # through this handle: next look-up at the new expiry
    await store._index.touch("theirs", 600)  # another process: found live when due
    await _until_due(store, ["gone"])
    await asyncio.sleep(max(0.0, store._producer.held["theirs"].due - time.monotonic()))
    asked.clear()
    assert await store.sweep() == 1
    assert sorted(asked) == ["gone", "theirs"]
    assert sorted(store._producer.held) == ["mine", "theirs"]
    asked.clear()
    assert await store.sweep() == 0 and asked == []  # "theirs" waits for its new expiry
    await store.delete("mine")  # through this handle: retired at once, no look-up
    assert await store.sweep() == 1 and asked == []


# --- readers drop the chunks of producers the index no longer names ---------------------------


def _foreign(
    producer: bytes, chunk: bytes, device: bytes = b"u" * 16, handle: bytes | None = None
) -> bytes:
    """An index record naming another process's (shareable) chunk (its own IPC handle unless
    ``handle`` says otherwise)."""
    share = ChunkShare(
        chunk * 16, 0, device, handle or chunk * 64, 4096, 0, b"/torch_1", 0, b"", False
    )
    return encode_record(IndexRecord(producer * 16, 1, share, 256, 16, "float32", (4,)))


async def test_reader_drops_chunks_of_producers_gone_from_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Foreign records in the index; opening their chunks is faked (no CUDA IPC on CPU)."""
    opened: list[bytes] = []
    bufs: dict[bytes, weakref.ref[torch.Tensor]] = {}

    def fake_open(share: ChunkShare) -> torch.Tensor:
        opened.append(share.chunk_id)
        buf = torch.zeros(share.storage_size_bytes, dtype=torch.uint8)
        bufs[share.chunk_id] = weakref.ref(buf)
        return buf

    collected: list[int] = []
    monkeypatch.setattr(cuda_mod, "_open", fake_open)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: collected.append(1))
    tag = uuid.uuid4().hex[:12]
    store = CudaStore(f"cuda://epd-test-{tag}?chunk_mb=1&sweep_interval_s=0", device=CPU)
    index = store._index
    try:
        await index.put_bytes("a1", _foreign(b"A", b"a"), 600)  # producer A, chunk a
        await index.put_bytes("a2", _foreign(b"A", b"a"), 600)
        await index.put_bytes("b1", _foreign(b"B", b"b"), 600)  # producer B, chunk b
        for k in ("a1", "a2", "b1", "a1"):
            assert torch.equal(await store.get(k), torch.zeros(4))
        assert opened == [b"a" * 16, b"b" * 16]  # each chunk opened once
        assert store.stats()["opened_producers"] == 2 and store.stats()["opened_chunks"] == 2
        # A's entries leave the index (deleted, or overwritten by another producer): the next
        # read drops A's chunk, keeps B's, and asks CUDA to release what was unmapped.
        await index.delete("a1")
        await index.put_bytes("a2", _foreign(b"C", b"c"), 600)
        await store.get("b1")
        assert store.stats()["opened_producers"] == 1 and store.stats()["opened_chunks"] == 1
        gc.collect()
        assert bufs[b"a" * 16]() is None and bufs[b"b" * 16]() is not None
        assert collected == [1]
        # A producer that still has an entry is kept; one dropped too early is just reopened.
        await store.get("a2")  # now C's
        await index.put_bytes("a3", _foreign(b"A", b"a"), 600)
        await store.get("a3")
        assert opened == [b"a" * 16, b"b" * 16, b"c" * 16, b"a" * 16]
        await store.sweep()
        assert store.stats()["opened_producers"] == 3  # A, B and C all have live entries
    finally:
        await store.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)


# --- the defects only a device would show, shown on the CPU with stand-ins -------------------


def _cpu_store(query: str) -> tuple[CudaStore, str]:
    tag = uuid.uuid4().hex[:12]
    return CudaStore(f"cuda://epd-test-{tag}?{query}", device=CPU), tag


def _remove(tag: str) -> None:
    for suffix in ("cuda-index", "cuda-live"):
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.{suffix}", ignore_errors=True)


async def test_reader_opens_the_producers_gpu_by_uuid(monkeypatch: pytest.MonkeyPatch) -> None:
    """The producer's device 0 is this reader's device 1 (another CUDA_VISIBLE_DEVICES): the
    record's UUID, not its index, decides which GPU the chunk is opened on."""
    uuids = [b"\x10" * 16, b"\x20" * 16]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda d: SimpleNamespace(uuid=SimpleNamespace(bytes=uuids[torch.device(d).index])),
    )
    opened_on: list[int] = []

    def fake_rebuild(*args: object) -> torch.Tensor:
        opened_on.append(int(args[6]))  # type: ignore[call-overload]  # storage_device
        return torch.zeros(int(args[8]), dtype=torch.uint8)  # type: ignore[call-overload]

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", fake_rebuild)
    store, tag = _cpu_store("chunk_mb=1&sweep_interval_s=3600")
    try:
        await store._index.put_bytes("k", _foreign(b"A", b"a", device=uuids[1]), 600)
        assert decode_record(await store._index.get_bytes("k")).chunk.device == 0
        assert torch.equal(await store.get("k"), torch.zeros(4))
        assert opened_on == [1]
        await store._index.put_bytes("gone", _foreign(b"B", b"b", device=b"\x30" * 16), 600)
        with pytest.raises(StoreUnavailable, match=r"GPU-30303030.*CUDA_VISIBLE_DEVICES"):
            await store.get("gone")
    finally:
        await store.close()
        _remove(tag)


def test_device_uuid_is_read_from_the_device_properties(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def props(d: object) -> SimpleNamespace:
        asked.append(d)
        return SimpleNamespace(uuid=SimpleNamespace(bytes=b"\x07" * 16))

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert cuda_mod._device_uuid(torch.device("cuda", 3)) == b"\x07" * 16
    assert asked == [torch.device("cuda", 3)]


async def test_reader_unmaps_dead_chunks_off_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer with a live chunk and a dead one: only the dead one is unmapped, and its last
    reference (where torch syncs the stream) and ipc_collect run off the event loop's thread."""
    loop_thread = threading.get_ident()
    released_on: list[int] = []

    def fake_open(share: ChunkShare) -> torch.Tensor:
        buf = torch.zeros(share.storage_size_bytes, dtype=torch.uint8)
        weakref.finalize(buf, lambda: released_on.append(threading.get_ident()))
        return buf

    collected_on: list[int] = []
    monkeypatch.setattr(cuda_mod, "_open", fake_open)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "ipc_collect", lambda: collected_on.append(threading.get_ident())
    )
    store, tag = _cpu_store("chunk_mb=1&sweep_interval_s=0")
    index = store._index
    try:
        await index.put_bytes("a1", _foreign(b"A", b"a"), 600)  # producer A, chunk a
        await index.put_bytes("a2", _foreign(b"A", b"b"), 600)  # producer A, chunk b
        await store.get("a1")
        await store.get("a2")
        assert store.stats()["opened_chunks"] == 2
        await index.delete("a1")  # chunk a holds nothing any more; chunk b still holds a2
        await store.get("a2")
        assert store.stats()["opened_producers"] == 1 and store.stats()["opened_chunks"] == 1
        gc.collect()
        assert len(released_on) == 1 and released_on[0] != loop_thread
        assert collected_on and loop_thread not in collected_on
    finally:
        await store.close()
        _remove(tag)


async def test_reader_opens_off_the_loop_and_drops_an_alias_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The producer gave chunk a back and torch put chunk b in the same memory (same IPC handle,
    same offset): the reader unmaps a before opening b, whose mapping torch's cache would
    otherwise answer with a's; opening runs off the event loop's thread."""
    loop_thread = threading.get_ident()
    events: list[tuple[str, bytes]] = []
    threads: set[int] = set()

    def fake_open(share: ChunkShare) -> torch.Tensor:
        threads.add(threading.get_ident())
        events.append(("open", share.chunk_id[:1]))
        buf = torch.zeros(share.storage_size_bytes, dtype=torch.uint8)
        weakref.finalize(buf, events.append, ("drop", share.chunk_id[:1]))
        return buf

    monkeypatch.setattr(cuda_mod, "_open", fake_open)
    store, tag = _cpu_store("chunk_mb=1&sweep_interval_s=3600")
    index = store._index
    try:
        await index.put_bytes("k1", _foreign(b"A", b"a", handle=b"h" * 64), 600)
        await store.get("k1")
        await index.put_bytes("k2", _foreign(b"A", b"b", handle=b"h" * 64), 600)  # a's memory
        await index.put_bytes("k3", _foreign(b"A", b"c"), 600)  # elsewhere: b stays open
        await store.get("k2")
        await store.get("k3")
        assert events == [("open", b"a"), ("drop", b"a"), ("open", b"b"), ("open", b"c")]
        assert loop_thread not in threads
        assert store.stats()["opened_chunks"] == 2
    finally:
        await store.close()
        _remove(tag)


async def test_empty_chunks_go_back_and_the_device_total_is_bounded() -> None:
    """Two store names share one device budget; deleted entries give their chunks back."""
    held = cuda_mod._DEVICE_RESERVED.get("cpu", 0)  # earlier tests' stores in this process
    cap_mb = (held + (2 << 20)) / (1 << 20)
    query = f"chunk_mb=1&grace_s=0&reclaim_s=0&sweep_interval_s=3600&device_max_mb={cap_mb}"
    a, tag_a = _cpu_store(query)
    b, tag_b = _cpu_store(query)
    kept, tag_k = _cpu_store("chunk_mb=1&grace_s=0&reclaim_s=600")
    mib = torch.zeros(1 << 18, dtype=torch.float32)  # 1 MiB: one whole chunk
    try:
        await a.put("x", mib)
        await a.put("y", mib)  # a holds all the device allows
        with pytest.raises(StoreUnavailable, match="device_max_mb"):
            await b.put("z", mib)
        chunks = [weakref.ref(c.buf) for c in a._producer.chunks]
        await a.delete("x")
        await a.delete("y")
        assert await a.sweep() == 2
        assert a.stats() | {"device_reserved_bytes": 0} == {
            "chunks": 0, "reserved_bytes": 0, "used_bytes": 0, "held": 0, "retired": 0,
            "opened_producers": 0, "opened_chunks": 0, "device_reserved_bytes": 0,
        }  # fmt: skip
        gc.collect()
        assert all(ref() is None for ref in chunks)  # the memory went back to torch
        await b.put("z", mib)  # room on the device again
        assert torch.equal(await b.get("z"), mib)
        # Within reclaim_s an empty chunk is kept for the next entry.
        await kept.put("k", mib)
        await kept.delete("k")
        await kept.sweep()
        assert kept.stats()["chunks"] == 1 and kept.stats()["used_bytes"] == 0
        await kept.put("k", mib)
        assert kept.stats()["chunks"] == 1
    finally:
        for store, tag in ((a, tag_a), (b, tag_b), (kept, tag_k)):
            await store.close()
            _remove(tag)


def test_settling_torchs_ipc_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one private torch call: the share's count given back at once; should it fail, the
    chunk is marked to be kept rather than dropped into torch's limbo."""
    calls: list[tuple[object, ...]] = []
    monkeypatch.setattr(
        torch.UntypedStorage, "_release_ipc_counter", lambda *a: calls.append(a), raising=False
    )
    assert cuda_mod._settle_ipc_count(b"/torch_1_2", 7) is True and calls == [(b"/torch_1_2", 7)]

    def broken(*a: object) -> None:
        raise RuntimeError("torch changed")

    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter", broken, raising=False)
    with pytest.warns(UserWarning, match="cannot be given back"):
        assert cuda_mod._settle_ipc_count(b"/torch_1_2", 7) is False


async def test_a_chunk_whose_count_is_unsettled_is_kept() -> None:
    store, tag = _cpu_store("chunk_mb=1&grace_s=0&reclaim_s=0")
    try:
        await store.put("k", torch.ones(4))
        store._producer.chunks[0].reclaimable = False
        await store.delete("k")
        assert await store.sweep() == 1
        assert store.stats()["chunks"] == 1 and store.stats()["used_bytes"] == 0
    finally:
        await store.close()
        _remove(tag)


def test_copy_fence_is_a_blocking_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """The put's wait sleeps on a blocking-sync event instead of spinning a core."""
    made: list[SimpleNamespace] = []

    class FakeEvent:
        def __init__(self, **kw: object) -> None:
            self.seen = SimpleNamespace(kw=kw, stream=None)
            made.append(self.seen)

        def record(self, stream: object) -> None:
            self.seen.stream = stream

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    assert cuda_mod._copy_fence(torch.device("cuda", 0)) is not None
    assert made[0].kw == {"blocking": True} and made[0].stream == "stream of cuda:0"
    assert cuda_mod._copy_fence(CPU) is None  # a CPU copy is done when copy_ returns


class _Gate:
    """A copy still running on a device stream: done once ``done`` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.waiting = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.waiting.set()
        self.done.wait(30)


async def test_cancelled_put_keeps_its_slot_until_its_copy_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _Gate()
    fences = iter([gate])
    monkeypatch.setattr(cuda_mod, "_copy_fence", lambda device: next(fences, None))
    store, tag = _cpu_store("chunk_mb=1&grace_s=0&reclaim_s=600&sweep_interval_s=3600")
    try:
        put = asyncio.create_task(store.put("k", torch.ones(64), ttl_s=60))
        assert await asyncio.to_thread(gate.waiting.wait, 30)  # waiting in a thread, not here
        put.cancel()
        with pytest.raises(asyncio.CancelledError):
            await put
        assert not await store.exists("k")
        assert store.stats()["used_bytes"] == SLOT_ALIGN and store.stats()["retired"] == 1
        assert await store.sweep() == 0  # grace_s=0, but the copy may still write the slot
        await store.put("k2", torch.ones(64))
        assert decode_record(await store._index.get_bytes("k2")).offset == SLOT_ALIGN  # not 0
        gate.done.set()
        assert await store.sweep() == 1
        assert store.stats()["used_bytes"] == SLOT_ALIGN
    finally:
        gate.done.set()
        await store.close()
        _remove(tag)


async def test_unopenable_chunk_of_a_running_producer_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """IPC refused while the producer runs: StoreUnavailable naming CUDA IPC, not "missing";
    once the producer has exited, its entries are missing (the pipeline re-encodes)."""

    def refused(share: ChunkShare) -> torch.Tensor:
        raise RuntimeError("CUDA error: operation not supported")

    monkeypatch.setattr(cuda_mod, "_open", refused)
    store, tag = _cpu_store("chunk_mb=1&sweep_interval_s=3600")
    lock = Path(f"/dev/shm/epd-test-{tag}.cuda-live") / (b"A" * 16).hex()  # A's lock
    try:
        await store._index.put_bytes("k", _foreign(b"A", b"a"), 600)
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)  # producer A runs (it holds its lock)
        try:
            with pytest.raises(StoreUnavailable, match=r"CUDA IPC.*producer is running"):
                await store.get("k")
            with pytest.raises(StoreUnavailable):
                await store.get_many(["k"])
        finally:
            os.close(fd)  # A exits
        with pytest.raises(StoreKeyMissing):
            await store.get("k")
        assert not lock.exists()  # a dead producer's lock file is tidied away
    finally:
        await store.close()
        _remove(tag)


# --- on a GPU ----------------------------------------------------------------------------------


@needs_cuda
async def test_cuda_same_process_stays_on_device() -> None:
    tag = uuid.uuid4().hex[:12]
    store = open_store(f"cuda://epd-test-{tag}")
    try:
        t = torch.randn(1369, 1536, device="cuda").to(torch.bfloat16)
        await store.put("emb", t, ttl_s=60)
        got = await store.get("emb")
        assert got.device.type == "cuda" and got.dtype == torch.bfloat16
        assert torch.equal(got, t) and got.data_ptr() != t.data_ptr()
    finally:
        await store.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)


@needs_cuda
async def test_cuda_cross_process_ipc() -> None:
    """A child process puts on the GPU and stays alive; this process waits, reads over CUDA IPC,
    puts a reply the child reads back the same way."""
    tag = uuid.uuid4().hex[:12]
    url = f"cuda://epd-test-{tag}"
    store = open_store(url)
    code = textwrap.dedent(
        f"""
        import asyncio, torch
        from runtime.stores import open_store
        async def main():
            s = open_store({url!r})
            t = torch.arange(1369 * 16, device="cuda").reshape(1369, 16).to(torch.bfloat16)
            await s.put("from-child", t, ttl_s=60)
            await s.wait(["from-parent"], 60)
            back = await s.get("from-parent")
            assert back.is_cuda and torch.equal(back, t * 2), "parent's value differs"
            await s.close()
        asyncio.run(main())
        """
    )
    try:
        waiter = asyncio.create_task(store.wait(["from-child"], timeout_s=120))
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, cwd=REPO_ROOT)
        await asyncio.wait_for(waiter, 120)
        got = await store.get("from-child")
        want = torch.arange(1369 * 16, device="cuda").reshape(1369, 16).to(torch.bfloat16)
        assert got.is_cuda and torch.equal(got, want)
        await store.put("from-parent", got * 2, ttl_s=60)
        assert await asyncio.wait_for(proc.wait(), 120) == 0
    finally:
        await store.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)


@needs_cuda
async def test_cuda_reclaimed_chunk_memory_returns_to_torch() -> None:
    """torch counts a reader per IPC share; the store settles that count when it shares a
    chunk, so a chunk no reader ever opened is freed when given back (not kept in torch's
    limbo)."""
    tag = uuid.uuid4().hex[:12]
    store = open_store(f"cuda://epd-test-{tag}?chunk_mb=64&grace_s=0&reclaim_s=0")
    assert isinstance(store, CudaStore)
    try:
        base = torch.cuda.memory_allocated()
        value = torch.ones(1 << 20, device="cuda")
        await store.put("k", value)
        del value
        assert torch.cuda.memory_allocated() >= base + (64 << 20)
        rec = decode_record(await store._index.get_bytes("k"))
        assert rec.chunk.device_uuid == bytes(torch.cuda.get_device_properties(0).uuid.bytes)
        await store.delete("k")
        await store.sweep()
        assert store.stats()["chunks"] == 0
        assert torch.cuda.memory_allocated() < base + (64 << 20)
    finally:
        await store.close()
        _remove(tag)
