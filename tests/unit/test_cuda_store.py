"""``cuda://`` beyond the shared store suite (tests/unit/test_stores.py runs that on it too).

On CPU: the index record codec, the slot allocator, URL parsing, the refusal without CUDA, and
slot lifetimes (grace, overwrite, full) through the store's test-only CPU mode. With CUDA: the
real thing, in one process and across two through CUDA IPC.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch

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
