"""``cuda://`` beyond the shared store suite (tests/unit/test_stores.py runs that on it too).

On CPU: the index record codec, the slot allocator, URL parsing, the refusal without CUDA, and
slot lifetimes (grace, overwrite, full) through the store's test-only CPU mode. With CUDA: the
real thing, in one process and across two through CUDA IPC.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import sys
import textwrap
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

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
    share = ChunkShare(b"c" * 16, 0, b"h" * 64, 1 << 20, 512, b"/torch_1_2", 3, b"e" * 64, True)
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
    await cpu_store.put("a", mib, ttl_s=0.05)
    await cpu_store.put("b", mib)
    assert cpu_store.stats()["chunks"] == 2
    with pytest.raises(StoreUnavailable, match="full"):  # max_mb=2, and both are live
        await cpu_store.put("c", mib)
    for _ in range(400):  # observe the expiry (not a timing assertion)
        if not await cpu_store.exists("a"):
            break
        await asyncio.sleep(0.025)
    await cpu_store.put("c", mib)  # the full store sweeps: a's slot is reused
    assert cpu_store.stats() | {"reserved_bytes": 0} == {
        "chunks": 2, "reserved_bytes": 0, "used_bytes": 2 << 20, "held": 2, "retired": 0,
        "opened_producers": 0, "opened_chunks": 0,
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
    for k in ("mine", "theirs", "gone"):
        await store.put(k, torch.ones(4), ttl_s=0.05)
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


def _foreign(producer: bytes, chunk: bytes) -> bytes:
    """An index record naming another process's (shareable) chunk."""
    share = ChunkShare(chunk * 16, 0, b"h" * 64, 4096, 0, b"/torch_1", 0, b"", False)
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
