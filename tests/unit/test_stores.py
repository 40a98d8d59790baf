"""Embedding stores: one behavioural suite run against redis://, shm:// and local://.

Redis tests use the real server on 127.0.0.1:6379, DB 14, under a unique key prefix per test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from gpu_workers.stores import (
    EmbeddingStore,
    StoreCorrupt,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
    open_store,
)
from gpu_workers.stores.shm import key_filename

REDIS_BASE = "redis://127.0.0.1:6379/14"
REPO_ROOT = str(Path(__file__).resolve().parents[2])
KINDS = ["redis", "shm", "local"]


async def _redis_up() -> bool:
    client = aioredis.Redis.from_url(REDIS_BASE)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


def _url(kind: str, tag: str) -> str:
    if kind == "redis":
        return f"{REDIS_BASE}?key_prefix=test-{tag}:"
    if kind == "shm":
        return f"shm://epd-test-{tag}"
    return f"local://test-{tag}"


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[EmbeddingStore]:
    kind = request.param
    if kind == "redis" and not await _redis_up():
        pytest.fail("Redis is not reachable on 127.0.0.1:6379 (start redis-server)")
    tag = uuid.uuid4().hex[:12]
    s = open_store(_url(kind, tag))
    try:
        yield s
    finally:
        await s.close()
        if kind == "shm":
            shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)
        if kind == "redis":
            client = aioredis.Redis.from_url(REDIS_BASE)
            keys = [k async for k in client.scan_iter(match=f"test-{tag}:*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


TENSORS = {
    "fp32": torch.randn(3, 5, generator=torch.Generator().manual_seed(0)),
    "bf16": torch.randn(7, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    "int64": torch.arange(-6, 6, dtype=torch.int64).reshape(2, 2, 3),
    "empty": torch.empty(0, 4, dtype=torch.float32),
    "scalar": torch.tensor(3.5, dtype=torch.float64),
    "noncontig": torch.arange(24, dtype=torch.int32).reshape(4, 6).t(),
}


@pytest.mark.parametrize("name", list(TENSORS))
async def test_round_trip(store: EmbeddingStore, name: str) -> None:
    t = TENSORS[name]
    await store.put(f"k-{name}", t, ttl_s=60)
    got = await store.get(f"k-{name}")
    assert got.dtype == t.dtype
    assert got.shape == t.shape
    assert torch.equal(got, t)


async def test_get_many_and_bytes(store: EmbeddingStore) -> None:
    await store.put("a", TENSORS["fp32"])
    await store.put("b", TENSORS["bf16"])
    a, b = await store.get_many(["a", "b"])
    assert torch.equal(a, TENSORS["fp32"]) and torch.equal(b, TENSORS["bf16"])
    await store.put_bytes("raw", b"\x00\x01claim-check\xff", ttl_s=30)
    assert await store.get_bytes("raw") == b"\x00\x01claim-check\xff"
    await store.put_bytes("raw-empty", b"")
    assert await store.get_bytes("raw-empty") == b""
    # get_bytes of a tensor value is its little-endian data
    assert await store.get_bytes("a") == TENSORS["fp32"].numpy().tobytes()
    with pytest.raises(StoreKeyMissing) as info:
        await store.get_many(["a", "nope-1", "b", "nope-2"])
    assert info.value.keys == ["nope-1", "nope-2"]


async def test_missing_key(store: EmbeddingStore) -> None:
    with pytest.raises(StoreKeyMissing) as info:
        await store.get("absent")
    assert isinstance(info.value, KeyError)
    assert info.value.key == "absent"
    assert "absent" in str(info.value)
    with pytest.raises(StoreKeyMissing):
        await store.get_bytes("absent")


async def test_exists_delete_overwrite(store: EmbeddingStore) -> None:
    assert not await store.exists("x")
    await store.put("x", torch.zeros(2))
    assert await store.exists("x")
    await store.put("x", torch.ones(3))  # replace
    assert torch.equal(await store.get("x"), torch.ones(3))
    await store.delete("x")
    assert not await store.exists("x")
    await store.delete("x")  # deleting an absent key is fine
    with pytest.raises(StoreKeyMissing):
        await store.get("x")


async def test_ttl_expiry(store: EmbeddingStore) -> None:
    await store.put("short", torch.ones(4), ttl_s=0.05)
    await store.put("long", torch.ones(4), ttl_s=600)
    await store.put("forever", torch.ones(4))
    # Poll only to observe expiry (not a timing assertion): it must happen eventually.
    for _ in range(400):
        if not await store.exists("short"):
            break
        await asyncio.sleep(0.025)
    assert not await store.exists("short")
    with pytest.raises(StoreKeyMissing):
        await store.get("short")
    assert await store.exists("long")
    assert await store.exists("forever")
    with pytest.raises(ValueError, match="ttl_s"):
        await store.put("bad", torch.ones(1), ttl_s=0)


async def test_wait_wakes_without_spinning(store: EmbeddingStore) -> None:
    waiter = asyncio.create_task(store.wait(["ready-1", "ready-2"], timeout_s=60))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    # Unrelated writes and idle time must not make the waiter re-check its keys.
    for i in range(20):
        await store.put(f"other-{i}", torch.ones(1))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    checks_before = store.wake_checks  # type: ignore[attr-defined]
    assert checks_before == 1, "the waiter re-checked without a relevant put: it spins"
    await store.put("ready-1", torch.ones(1))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await store.put("ready-2", torch.ones(1))
    await asyncio.wait_for(waiter, 30)
    # one initial check + at most one per relevant put
    assert store.wake_checks <= checks_before + 2  # type: ignore[attr-defined]


async def test_wait_already_present_and_empty(store: EmbeddingStore) -> None:
    await store.put("here", torch.ones(1))
    await store.wait(["here"], timeout_s=5)
    await store.wait([], timeout_s=5)


async def test_wait_timeout_names_missing(store: EmbeddingStore) -> None:
    await store.put("present", torch.ones(1))
    with pytest.raises(StoreTimeout) as info:
        await store.wait(["present", "gone-a", "gone-b"], timeout_s=0.2)
    assert info.value.missing == ["gone-a", "gone-b"]
    assert "gone-a" in str(info.value) and "present" not in info.value.missing
    assert isinstance(info.value, TimeoutError)


async def test_concurrent_waiters_same_key(store: EmbeddingStore) -> None:
    waiters = [asyncio.create_task(store.wait(["shared"], timeout_s=60)) for _ in range(5)]
    await asyncio.sleep(0.05)
    await store.put("shared", torch.ones(1))
    await asyncio.wait_for(asyncio.gather(*waiters), 30)


def test_open_store_schemes() -> None:
    with pytest.raises(ValueError, match=r"redis://.*shm://.*local://"):
        open_store("ftp://nowhere")
    with pytest.raises(NotImplementedError, match="cuda"):
        open_store("cuda://0")
    with pytest.raises(ValueError, match="shm store name"):
        open_store("shm://../etc")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_redis_down_is_unavailable() -> None:
    s = open_store(f"redis://127.0.0.1:{_closed_port()}/0")
    try:
        with pytest.raises(StoreUnavailable):
            await s.put("k", torch.ones(1))
        with pytest.raises(StoreUnavailable):
            await s.get("k")
        with pytest.raises(StoreUnavailable):
            await s.exists("k")
        with pytest.raises(StoreUnavailable):
            await s.wait(["k"], timeout_s=10)
        assert isinstance(StoreUnavailable("x"), ConnectionError)
    finally:
        await s.close()


async def test_redis_corrupt_value() -> None:
    tag = uuid.uuid4().hex[:12]
    s = open_store(_url("redis", tag))
    client = aioredis.Redis.from_url(REDIS_BASE)
    try:
        await client.set(f"test-{tag}:junk", b"definitely not a blob", px=60000)
        with pytest.raises(StoreCorrupt, match="junk"):
            await s.get("junk")
    finally:
        await client.delete(f"test-{tag}:junk")
        await client.aclose()
        await s.close()


async def test_local_same_name_shares_space() -> None:
    tag = uuid.uuid4().hex[:8]
    a, b, other = (
        open_store(f"local://{tag}"),
        open_store(f"local://{tag}"),
        open_store("local://x"),
    )
    await a.put("k", torch.ones(2))
    assert torch.equal(await b.get("k"), torch.ones(2))
    assert not await other.exists("k")


def test_shm_key_filenames() -> None:
    assert key_filename("ec:model:abc") == "ec%3Amodel%3Aabc"
    assert key_filename("a/b") == "a%2Fb"
    assert not key_filename(".tmp-x").startswith(".")
    assert key_filename("..") != ".."
    long = key_filename("k" * 500)
    assert long.startswith("%H") and len(long) < 100
    assert key_filename("x" * 500) != long


async def test_shm_cross_process() -> None:
    tag = uuid.uuid4().hex[:12]
    url = f"shm://epd-test-{tag}"
    s = open_store(url)
    try:
        waiter = asyncio.create_task(s.wait(["ec:model:item0"], timeout_s=120))
        code = textwrap.dedent(
            f"""
            import asyncio, torch
            from gpu_workers.stores import open_store
            async def main():
                s = open_store({url!r})
                t = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
                await s.put("ec:model:item0", t, ttl_s=60)
                await s.close()
            asyncio.run(main())
            """
        )
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, cwd=REPO_ROOT)
        assert await proc.wait() == 0
        await asyncio.wait_for(waiter, 60)
        got = await s.get("ec:model:item0")
        expect = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
        assert torch.equal(got, expect)
        # zero-copy: the tensor views the file mapping, whose data starts 64-byte aligned
        assert got.data_ptr() % 64 == 0
    finally:
        await s.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)


async def test_shm_corrupt_file_and_sweep() -> None:
    tag = uuid.uuid4().hex[:12]
    s = open_store(f"shm://epd-test-{tag}")
    try:
        await asyncio.to_thread(Path(f"/dev/shm/epd-test-{tag}/junk").write_bytes, b"nope" * 10)
        with pytest.raises(StoreCorrupt, match="junk"):
            await s.get("junk")
        await s.delete("junk")
        await s.put("old", torch.ones(1), ttl_s=0.01)
        await s.put("keep", torch.ones(1))
        for _ in range(400):
            if not await s.exists("old"):
                break
            await asyncio.sleep(0.025)
        removed = await asyncio.to_thread(s.sweep)  # type: ignore[attr-defined]
        assert removed == 1
        assert not await asyncio.to_thread(os.path.exists, f"/dev/shm/epd-test-{tag}/old")
        assert await s.exists("keep")
    finally:
        await s.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)
