"""Embedding stores: one behavioural suite run against redis:// (over both of its I/O paths:
the wire client and redis-py), redis+cluster:// (a real 3-master Redis Cluster of this session),
shm://, local:// and cuda:// (on CPU memory everywhere, through its test-only ``device``
keyword; on the GPU too where CUDA is present).

Redis tests use the real server on 127.0.0.1:6379, DB 14, under a unique key prefix per test.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import socket
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
import redis.exceptions as rexc
import torch
from redis.exceptions import AuthenticationWrongNumberOfArgsError as AuthWrongArgs

from runtime.stores import (
    StoreCorrupt,
    StoreError,
    StoreKeyMissing,
    StoreTimeout,
    StoreUnavailable,
    open_store,
)
from runtime.stores import redis_wire as wire
from runtime.stores.base import EmbeddingStore, pack_tensors, unpack_tensors
from runtime.stores.cuda import CudaStore
from runtime.stores.redis import RedisStore
from runtime.stores.shm import ShmStore, key_filename

REDIS_BASE = "redis://127.0.0.1:6379/14"
REPO_ROOT = str(Path(__file__).resolve().parents[2])
SHORT_TTL_S = 1.0
"""A TTL that must outlast the next few commands (a touch, a read) even on a host so loaded
that a task stalls for a good part of a second, and still expire within the test."""

KINDS = ["redis", "redis-py", "cluster", "shm", "local", "cuda-cpu"] + (
    ["cuda"] if torch.cuda.is_available() else []
)


def _eq(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal across devices (a cuda:// store hands back device tensors)."""
    return torch.equal(a.cpu(), b.cpu())


async def _redis_up() -> bool:
    client = aioredis.Redis.from_url(REDIS_BASE)
    try:
        return bool(await client.ping())
    except Exception:
        return False
    finally:
        await client.aclose()


def _url(kind: str, tag: str, cluster: Any = None) -> str:
    if kind == "cluster":
        return f"{cluster.url}?key_prefix=test-{tag}:"
    if kind in ("redis", "redis-py"):
        return f"{REDIS_BASE}?key_prefix=test-{tag}:"
    if kind == "shm":
        return f"shm://epd-test-{tag}"
    if kind.startswith("cuda"):
        return f"cuda://epd-test-{tag}?chunk_mb=1&grace_s=0"
    return f"local://test-{tag}"


@pytest.fixture(params=KINDS)
async def store(request: pytest.FixtureRequest) -> AsyncIterator[EmbeddingStore]:
    kind = request.param
    if kind.startswith("redis") and not await _redis_up():
        pytest.fail("Redis is not reachable on 127.0.0.1:6379 (start redis-server)")
    tag = uuid.uuid4().hex[:12]
    cluster = request.getfixturevalue("redis_cluster") if kind == "cluster" else None
    url = _url(kind, tag, cluster)
    if kind == "redis-py":
        s: EmbeddingStore = RedisStore(url, wire_io=False)
    elif kind == "cuda-cpu":
        s = CudaStore(url, device=torch.device("cpu"))
    else:
        s = open_store(url)
    if kind.startswith("redis"):
        assert isinstance(s, RedisStore)
        assert (s.wire_pool is not None) == (kind == "redis")
    try:
        yield s
    finally:
        await s.close()
        if kind == "shm":
            shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)
        if kind.startswith("cuda"):
            shutil.rmtree(f"/dev/shm/epd-test-{tag}.cuda-index", ignore_errors=True)
        if cluster is not None:
            cluster.delete(f"test-{tag}:*")
        if kind.startswith("redis"):
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
    assert _eq(got, t)


async def test_get_many_and_bytes(store: EmbeddingStore) -> None:
    await store.put("a", TENSORS["fp32"])
    await store.put("b", TENSORS["bf16"])
    a, b = await store.get_many(["a", "b"])
    assert _eq(a, TENSORS["fp32"]) and _eq(b, TENSORS["bf16"])
    await store.put_bytes("raw", b"\x00\x01claim-check\xff", ttl_s=30)
    assert await store.get_bytes("raw") == b"\x00\x01claim-check\xff"
    await store.put_bytes("raw-empty", b"")
    assert await store.get_bytes("raw-empty") == b""
    # get_bytes of a tensor value is its little-endian data
    assert await store.get_bytes("a") == TENSORS["fp32"].numpy().tobytes()
    with pytest.raises(StoreKeyMissing) as info:
        await store.get_many(["a", "nope-1", "b", "nope-2"])
    assert info.value.keys == ["nope-1", "nope-2"]


async def test_multi_tensor_entry_round_trip(store: EmbeddingStore) -> None:
    """Several named tensors (an item's embedding + deepstack features) are ONE entry: one key,
    one wait, one TTL; every dtype, shape and name comes back, in order."""
    entry = {
        "embeds": TENSORS["bf16"],
        "deepstack": torch.randn(3, 7, 16).to(torch.bfloat16),
        "int": TENSORS["int64"],
        "empty": TENSORS["empty"],
        "noncontig": TENSORS["noncontig"],
    }
    waiter = asyncio.create_task(store.wait(["item"], timeout_s=5))
    await asyncio.sleep(0.05)
    await store.put_tensors("item", entry, ttl_s=60)
    await waiter
    got = await store.get_tensors("item")
    assert list(got) == list(entry)
    for name, t in entry.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape
        assert _eq(got[name], t), name
    await store.put_tensors("other", {"embeds": TENSORS["fp32"]})
    a, b = await store.get_tensors_many(["item", "other"])
    assert _eq(a["deepstack"], entry["deepstack"])
    assert _eq(b["embeds"], TENSORS["fp32"])
    assert await store.touch("item", 30)
    with pytest.raises(StoreKeyMissing) as info:
        await store.get_tensors_many(["item", "gone"])
    assert info.value.keys == ["gone"]


async def test_multi_tensor_entry_refuses_other_values(store: EmbeddingStore) -> None:
    """A single-tensor value, or a packed entry with one flipped byte, is StoreCorrupt."""
    await store.put("single", TENSORS["fp32"])
    with pytest.raises(StoreCorrupt, match="not a multi-tensor entry"):
        await store.get_tensors("single")
    blob = pack_tensors({"embeds": TENSORS["fp32"], "deepstack": TENSORS["fp32"] * 2})
    blob[-1] ^= 0x01
    await store.put_bytes("torn", bytes(blob))
    with pytest.raises(StoreCorrupt, match="digest"):
        await store.get_tensors("torn")
    with pytest.raises(StoreKeyMissing):
        await store.get_tensors("absent")


def test_pack_tensors_layout_limits() -> None:
    with pytest.raises(ValueError):
        pack_tensors({})
    blob = pack_tensors({"a": torch.arange(5, dtype=torch.int16)})
    assert bytes(blob[:4]) == b"EPDM"
    with pytest.raises(StoreCorrupt, match="digest"):
        unpack_tensors(blob[:-2])
    got = unpack_tensors(blob)
    assert _eq(got["a"], torch.arange(5, dtype=torch.int16))


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
    assert _eq(await store.get("x"), torch.ones(3))
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
    # Until its first look (a cluster store subscribes on two masters first: on a loaded
    # machine that can take a while); what is measured is what happens after it.
    for _ in range(200):
        if store.wake_checks:  # type: ignore[attr-defined]
            break
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


async def test_a_redis_wait_trusts_what_it_heard() -> None:
    # SET and PUBLISH are one MULTI/EXEC: a key heard on the channel is there, so the wake costs
    # no EXISTS round trip of its own. One check when the wait begins, none after.
    if not await _redis_up():
        pytest.fail("Redis is not reachable on 127.0.0.1:6379 (start redis-server)")
    tag = uuid.uuid4().hex[:12]
    store = RedisStore(_url("redis", tag))
    try:
        await store.put("heard-0", torch.ones(1))
        waiter = asyncio.create_task(store.wait(["heard-0", "heard-1", "heard-2"], timeout_s=60))
        await asyncio.sleep(0.05)
        assert not waiter.done() and store.wake_checks == 1
        await store.put("heard-1", torch.ones(1))
        await asyncio.sleep(0.05)
        assert not waiter.done(), "returned before every key was there"
        await store.put("heard-2", torch.ones(1))
        await asyncio.wait_for(waiter, 30)
        assert store.wake_checks == 1
    finally:
        await store.close()
        client = aioredis.Redis.from_url(REDIS_BASE)
        keys = [k async for k in client.scan_iter(match=f"test-{tag}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


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
    if not torch.cuda.is_available():
        with pytest.raises(StoreError, match=r"need CUDA.*shm://.*redis://"):
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
    assert _eq(await b.get("k"), torch.ones(2))
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
            from runtime.stores import open_store
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
        assert _eq(got, expect)
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
        # Long enough that "keep"'s put (which may sweep) comes first on a loaded machine.
        await s.put("old", torch.ones(1), ttl_s=0.5)
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


# --- redis: the wire client's connection handling ---------------------------------------------


@pytest.fixture
async def redis_pair() -> AsyncIterator[tuple[RedisStore, aioredis.Redis, str]]:
    """A wire-path store, a plain redis-py client on the same DB, and the store's key prefix."""
    if not await _redis_up():
        pytest.fail("Redis is not reachable on 127.0.0.1:6379 (start redis-server)")
    tag = uuid.uuid4().hex[:12]
    store = RedisStore(_url("redis", tag))
    client = aioredis.Redis.from_url(REDIS_BASE)
    try:
        yield store, client, f"test-{tag}:"
    finally:
        await store.close()
        keys = [k async for k in client.scan_iter(match=f"test-{tag}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


def _big(numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, (numel,), dtype=torch.int16, generator=gen)


async def test_redis_wire_big_values_and_concurrency(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    store, client, prefix = redis_pair
    # odd sizes around a few MiB cross every receive-chunk boundary
    values = {f"big-{i}": _big((1 << 20) + 2 * i + 1, i) for i in range(6)}
    await asyncio.gather(*(store.put(k, v, ttl_s=60) for k, v in values.items()))
    got = await asyncio.gather(*(store.get(k) for k in values))
    for (k, v), g in zip(values.items(), got, strict=True):
        assert _eq(g, v), k
    many = await store.get_many(list(values))
    assert all(_eq(a, b) for a, b in zip(many, values.values(), strict=True))
    # what the wire client wrote is an ordinary Redis value redis-py reads back the same way
    other = RedisStore(f"{REDIS_BASE}?key_prefix={prefix}", wire_io=False)
    try:
        assert _eq(await other.get("big-3"), values["big-3"])
    finally:
        await other.close()
    ttl_ms = await client.pttl(f"{prefix}big-0")
    assert 0 < ttl_ms <= 60_000


async def test_redis_wire_reuses_connection_and_recovers_from_a_killed_one(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    store, client, _ = redis_pair
    pool = store.wire_pool
    assert pool is not None
    await store.put("k", torch.arange(5))
    assert _eq(await store.get("k"), torch.arange(5))
    assert pool.opened == 1

    async def client_id(conn: object) -> int:
        await conn.send(b"*2\r\n$6\r\nCLIENT\r\n$2\r\nID\r\n")  # type: ignore[attr-defined]
        (cid,) = await conn.replies(1)  # type: ignore[attr-defined]
        return int(cid)

    cid = await pool.run(client_id)
    assert await client.execute_command("CLIENT", "KILL", "ID", cid) == 1
    # the idle connection is dead: the next command notices and retries on a fresh one
    assert _eq(await store.get("k"), torch.arange(5))
    assert pool.opened == 2


async def test_redis_wire_drops_every_idle_connection_once_one_is_found_dead(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    """What a Redis restart leaves: several idle connections, all dead. One retry on the next
    idle one would meet another dead one and fail the command (a prefill worker then took a
    lost embedding for one still to come and waited its full timeout)."""
    store, client, _ = redis_pair
    pool = store.wire_pool
    assert pool is not None
    await store.put("k", torch.arange(3))
    hold = asyncio.Event()

    async def park(conn: object) -> None:
        await hold.wait()  # keeps this connection busy, so each task opens its own

    tasks = [asyncio.create_task(pool.run(park)) for _ in range(3)]
    await asyncio.sleep(0.05)
    hold.set()
    await asyncio.gather(*tasks)
    assert pool.opened >= 3
    killed = await client.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 3
    opened = pool.opened
    # every idle connection is dead now: the first command retries once, on a fresh one
    assert _eq(await store.get("k"), torch.arange(3))
    assert await store.exists("k")
    assert pool.opened == opened + 1


async def test_redis_wire_holds_a_burst_to_its_connection_bound(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    """A burst of commands beyond ``max_connections`` waits for a free connection, as redis-py's
    blocking pool does, instead of opening one each (Redis's ``maxclients``)."""
    _, _, prefix = redis_pair
    store = RedisStore(f"{REDIS_BASE}?key_prefix={prefix}&max_connections=3")
    pool = store.wire_pool
    assert pool is not None and pool.max_connections == 3
    busy = 0
    most = 0

    async def slow(conn: object) -> None:
        nonlocal busy, most
        busy += 1
        most = max(most, busy)
        await asyncio.sleep(0.02)
        busy -= 1

    try:
        await asyncio.gather(*(pool.run(slow) for _ in range(20)))
        assert most == 3 and pool.opened == 3
        await store.put("k", torch.arange(4))
        values = await asyncio.gather(*(store.get("k") for _ in range(40)))
        assert all(_eq(v, torch.arange(4)) for v in values)
        assert pool.opened == 3
    finally:
        await store.close()


async def test_redis_wire_waits_for_a_connection_only_so_long(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    pool = wire.WirePool("127.0.0.1", 6379, max_connections=1, pool_wait_s=0.1)
    hold = asyncio.Event()

    async def park(conn: object) -> None:
        await hold.wait()

    parked = asyncio.create_task(pool.run(park))
    await asyncio.sleep(0.05)
    with pytest.raises(rexc.ConnectionError, match="no free connection"):
        await pool.run(park)
    hold.set()
    await parked
    await pool.run(park)  # the slot came back
    pool.close()
    with pytest.raises(ValueError, match="max_connections"):
        wire.WirePool("127.0.0.1", 6379, max_connections=0)


async def test_redis_error_reply_is_redis_pys_error_on_both_paths(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    store, client, prefix = redis_pair
    await client.rpush(f"{prefix}a-list", b"x")
    await store.put("fine", torch.ones(3))
    py = RedisStore(f"{REDIS_BASE}?key_prefix={prefix}", wire_io=False)
    try:
        for s in (store, py):
            with pytest.raises(rexc.ResponseError, match="WRONGTYPE"):
                await s.get("a-list")
            # the connection stayed in step: the next reply belongs to the next command
            assert _eq(await s.get("fine"), torch.ones(3))
    finally:
        await py.close()
    assert store.wire_pool is not None and store.wire_pool.opened == 1


async def test_redis_wire_cancelled_get_does_not_poison_the_pool(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    store, _, _ = redis_pair
    big, small = _big(3 << 20, 7), torch.arange(4)
    await store.put("big", big)
    await store.put("small", small)
    for yields in range(4):  # cancel at different points of the transfer
        task = asyncio.create_task(store.get("big"))
        for _ in range(yields):
            await asyncio.sleep(0)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert _eq(await store.get("small"), small)
        assert _eq(await store.get("big"), big)


@pytest.mark.parametrize("wire_io", [True, False])
async def test_redis_bad_password_is_unavailable(wire_io: bool) -> None:
    if not await _redis_up():
        pytest.fail("Redis is not reachable on 127.0.0.1:6379 (start redis-server)")
    s = RedisStore("redis://no-such-user-epd:pw@127.0.0.1:6379/14", wire_io=wire_io)
    try:
        with pytest.raises(StoreUnavailable):
            await s.get("k")
    finally:
        await s.close()


# --- shm: the mapping cache -------------------------------------------------------------------


@pytest.fixture
async def shm_pair() -> AsyncIterator[tuple[ShmStore, ShmStore]]:
    """Two handles on one shm directory (a writer and a reader, as in two processes)."""
    tag = uuid.uuid4().hex[:12]
    a, b = ShmStore(f"shm://epd-test-{tag}"), ShmStore(f"shm://epd-test-{tag}")
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)


async def test_shm_reuses_mapping_of_an_unchanged_file(shm_pair: tuple[ShmStore, ShmStore]) -> None:
    writer, reader = shm_pair
    await writer.put("k", torch.arange(64, dtype=torch.float32))
    first, second = await reader.get("k"), await reader.get("k")
    assert first.data_ptr() == second.data_ptr()
    assert reader.cached_mappings == 1


async def test_shm_cached_mapping_never_serves_a_replaced_value(
    shm_pair: tuple[ShmStore, ShmStore],
) -> None:
    writer, reader = shm_pair
    old = torch.zeros(256, dtype=torch.bfloat16)
    await writer.put("k", old)
    held = await reader.get("k")
    for i in range(1, 4):  # same dtype, shape and size every time: only the file identity differs
        new = torch.full((256,), float(i), dtype=torch.bfloat16)
        await writer.put("k", new)
        assert _eq(await reader.get("k"), new)
    assert _eq(held, old)  # a tensor handed out earlier still sees its own bytes
    await writer.delete("k")
    with pytest.raises(StoreKeyMissing):
        await reader.get("k")
    assert reader.cached_mappings == 0


async def test_shm_cached_mapping_expires(shm_pair: tuple[ShmStore, ShmStore]) -> None:
    writer, reader = shm_pair
    await writer.put("short", torch.ones(4), ttl_s=SHORT_TTL_S)
    assert _eq(await reader.get("short"), torch.ones(4))
    assert reader.cached_mappings == 1
    for _ in range(400):
        if not await reader.exists("short"):
            break
        await asyncio.sleep(0.025)
    with pytest.raises(StoreKeyMissing):
        await reader.get("short")
    assert reader.cached_mappings == 0


async def test_shm_mapping_cache_limits() -> None:
    tag = uuid.uuid4().hex[:12]
    blob = 64 + 4096  # header + data of one value below
    bounded = ShmStore(f"shm://epd-test-{tag}?map_cache_bytes={3 * blob}")
    off = ShmStore(f"shm://epd-test-{tag}?map_cache_bytes=0")
    idle = ShmStore(f"shm://epd-test-{tag}?map_cache_idle_s=0")
    try:
        for i in range(5):
            await bounded.put(f"k{i}", torch.full((1024,), float(i)))
        for i in range(5):
            for s in (bounded, off, idle):
                assert _eq(await s.get(f"k{i}"), torch.full((1024,), float(i)))
        assert bounded.cached_mappings == 3  # least recently used went first
        assert _eq(await bounded.get("k4"), torch.full((1024,), 4.0))
        assert off.cached_mappings == 0
        await asyncio.sleep(0.01)
        await idle.get("k0")
        assert idle.cached_mappings == 1  # the idle ones went on this get
        await bounded.delete("k4")
        assert bounded.cached_mappings == 2
    finally:
        for s in (bounded, off, idle):
            await s.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)


# --- touch: a cache hit extends the lifetime ----------------------------------------------------


async def _until_gone(store: EmbeddingStore, key: str) -> None:
    """Poll until ``key`` expires (observing expiry, not timing it)."""
    for _ in range(400):
        if not await store.exists(key):
            return
        await asyncio.sleep(0.025)
    raise AssertionError(f"{key} never expired")


async def test_touch_extends_a_short_ttl(store: EmbeddingStore) -> None:
    t = TENSORS["bf16"]
    await store.put("short", t, ttl_s=SHORT_TTL_S)
    await store.put("canary", torch.ones(1), ttl_s=SHORT_TTL_S)  # same TTL, not touched
    assert await store.touch("short", 60) is True
    await _until_gone(store, "canary")  # the original TTL has certainly passed now
    assert await store.exists("short")
    got = await store.get("short")
    assert got.dtype == t.dtype and _eq(got, t)
    assert _eq((await store.get_many(["short"]))[0], t)


async def test_touch_to_no_expiry_and_back(store: EmbeddingStore) -> None:
    await store.put("k", torch.arange(6), ttl_s=SHORT_TTL_S)
    assert await store.touch("k", None) is True
    await store.put("canary", torch.ones(1), ttl_s=SHORT_TTL_S)
    await _until_gone(store, "canary")
    assert _eq(await store.get("k"), torch.arange(6))
    assert await store.touch("k", 0.05) is True  # a touch may shorten it, too
    await _until_gone(store, "k")
    with pytest.raises(ValueError, match="ttl_s"):
        await store.touch("k", 0)


async def test_touch_of_a_missing_or_expired_key_is_false_and_creates_nothing(
    store: EmbeddingStore,
) -> None:
    assert await store.touch("never-put", 60) is False
    assert not await store.exists("never-put")
    with pytest.raises(StoreKeyMissing):
        await store.get("never-put")
    await store.put("short", torch.ones(2), ttl_s=0.05)
    await _until_gone(store, "short")
    assert await store.touch("short", 60) is False
    assert await store.touch("short", None) is False
    assert not await store.exists("short")
    with pytest.raises(StoreKeyMissing):
        await store.get("short")
    await store.put("gone", torch.ones(2))
    await store.delete("gone")
    assert await store.touch("gone", 60) is False
    assert not await store.exists("gone")


async def test_shm_touch_keeps_held_views_and_refreshes_other_handles(
    shm_pair: tuple[ShmStore, ShmStore],
) -> None:
    writer, reader = shm_pair
    value = torch.arange(256, dtype=torch.float32)
    await writer.put("k", value, ttl_s=SHORT_TTL_S)
    held = await reader.get("k")  # a zero-copy view, and a cached mapping in the reader
    assert reader.cached_mappings == 1
    assert await writer.touch("k", 60) is True
    await writer.put("canary", torch.ones(1), ttl_s=SHORT_TTL_S)
    await _until_gone(reader, "canary")
    # the reader's cached mapping (keyed on the old mtime) must not make it read the old expiry
    assert _eq(await reader.get("k"), value)
    assert _eq(held, value)  # the data bytes were never rewritten
    removed = await asyncio.to_thread(writer.sweep)
    assert removed == 1  # the canary only: the touched file survives the sweep
    assert _eq(await reader.get("k"), value)


async def test_shm_touch_of_a_foreign_file_is_corrupt() -> None:
    tag = uuid.uuid4().hex[:12]
    s = ShmStore(f"shm://epd-test-{tag}")
    try:
        path = Path(f"/dev/shm/epd-test-{tag}/junk")
        await asyncio.to_thread(path.write_bytes, b"nope" * 10)
        future_ns = 2**61
        await asyncio.to_thread(os.utime, path, ns=(future_ns, future_ns))
        with pytest.raises(StoreCorrupt, match="junk"):
            await s.touch("junk", 60)
        assert await asyncio.to_thread(path.read_bytes) == b"nope" * 10
    finally:
        await s.close()
        shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)


# --- redis: the readiness listener dying ------------------------------------------------------


def _listener_addr(store: RedisStore) -> str:
    """``ip:port`` of the store's pub/sub connection, as CLIENT LIST/KILL name it (so the test
    kills only its own connection on a server other runs may share)."""
    listener = store._listener
    assert listener is not None and listener.pubsub is not None
    conn = listener.pubsub.connection
    assert conn is not None
    host, port = conn._writer.get_extra_info("sockname")[:2]
    return f"{host}:{port}"


async def test_redis_listener_killed_while_waiting_fails_the_wait_promptly(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    store, client, _ = redis_pair
    await store._ensure_subscribed()
    waiter = asyncio.create_task(store.wait(["never"], timeout_s=10))
    await asyncio.sleep(0.05)  # let the waiter register (if it has not, the kill is caught anyway)
    assert not waiter.done()
    assert await client.execute_command("CLIENT", "KILL", "ADDR", _listener_addr(store))
    with pytest.raises(StoreUnavailable, match="readiness"):
        await waiter  # not StoreTimeout after 10 s
    # the next wait subscribes afresh and is woken by a put
    again = asyncio.create_task(store.wait(["later"], timeout_s=60))
    await asyncio.sleep(0.05)
    await store.put("later", torch.ones(1))
    await asyncio.wait_for(again, 30)


async def test_redis_listener_dying_before_the_waiters_register_fails_the_wait(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    """The subscription is confirmed, then the listener dies (and fails the waiters it knows)
    before this wait has registered its futures: nobody would ever wake them."""
    _, client, prefix = redis_pair

    class DiesAfterConfirming(RedisStore):
        async def _ensure_subscribed(self) -> Any:
            listener = await super()._ensure_subscribed()
            await client.execute_command("CLIENT", "KILL", "ADDR", _listener_addr(self))
            assert listener.task is not None
            await listener.task  # it has noticed, failed the waiters it knew of, and ended
            assert listener.stopped
            return listener

    s = DiesAfterConfirming(f"{REDIS_BASE}?key_prefix={prefix}")
    try:
        with pytest.raises(StoreUnavailable):
            await s.wait(["never"], timeout_s=10)  # not StoreTimeout after 10 s
    finally:
        await s.close()


@pytest.mark.parametrize(
    ("message", "cls", "text"),
    [
        ("WRONGTYPE Operation against a key", rexc.ResponseError, "WRONGTYPE Operation"),
        ("ERR unknown command 'X'", rexc.ResponseError, "unknown command 'X'"),
        ("WRONGPASS invalid username-password pair", rexc.AuthenticationError, "invalid user"),
        ("ERR wrong number of arguments for 'auth' command", AuthWrongArgs, "wrong number"),
        ("EXECABORT Transaction discarded", rexc.ExecAbortError, "Transaction discarded"),
        ("LOADING Redis is loading", rexc.BusyLoadingError, "Redis is loading"),
    ],
)
def test_wire_error_replies_map_to_redis_pys_classes(
    message: str, cls: type[Exception], text: str
) -> None:
    err = wire.reply_error(message)
    assert type(err) is cls
    assert str(err).startswith(text)


async def test_wire_protocol_garbage_is_a_connection_error() -> None:
    """A reply stream hiredis cannot parse fails the command as a connection error (so the pool
    closes that connection) instead of returning nonsense."""
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = wire.WireConnection(a, asyncio.get_running_loop())
    try:
        b.sendall(b"?garbage\r\n")
        with pytest.raises(rexc.ConnectionError):
            await conn.reply()
    finally:
        conn.close()
        b.close()


# --- redis: the wire client's direct receive of big GET values ---------------------------------


class _SplitLoop:
    """The running loop, except that each receive returns at most a few bytes (sizes taken in
    turn from ``sizes``), so a reply arrives in many pieces: header and final CRLF included."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sizes: tuple[int, ...]) -> None:
        self._loop, self._sizes, self.recvs = loop, itertools.cycle(sizes), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    async def sock_recv_into(self, sock: socket.socket, buf: Any) -> int:
        self.recvs += 1
        return await self._loop.sock_recv_into(sock, memoryview(buf)[: next(self._sizes)])


@contextlib.asynccontextmanager
async def _wire_conn(
    stream: bytes, sizes: tuple[int, ...] | None = None
) -> AsyncIterator[tuple[wire.WireConnection, _SplitLoop | None]]:
    """A wire connection over a socket pair whose far end sends ``stream`` (then stays open);
    the test body must finish within 10 s (a reply lost or swallowed would hang it)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    split = _SplitLoop(loop, sizes) if sizes else None
    conn = wire.WireConnection(a, cast(asyncio.AbstractEventLoop, split or loop))
    sender = asyncio.create_task(loop.sock_sendall(b, stream))
    try:
        async with asyncio.timeout(10):
            yield conn, split
            await sender
    finally:
        sender.cancel()
        conn.close()
        b.close()


def _bulk(payload: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(payload), payload)


@pytest.mark.parametrize("sizes", [None, (1, 2, 3, 7, 4093, 1 << 16)], ids=["whole", "split"])
@pytest.mark.parametrize(
    "n", [0, 10, wire._DIRECT_MIN - 1, wire._DIRECT_MIN, wire._DIRECT_MIN + 1, 3 << 20 | 5]
)
async def test_wire_bulk_reply_around_the_direct_threshold(
    n: int, sizes: tuple[int, ...] | None
) -> None:
    """Values from the threshold up are received in place (a bytearray of their own), shorter
    ones through hiredis (bytes); either way the bytes are right and the stream stays in step."""
    payload = os.urandom(n)
    async with _wire_conn(_bulk(payload) + b":7\r\n", sizes) as (conn, split):
        value = await conn.bulk_reply()
        assert value == payload
        assert type(value) is (bytearray if n >= wire._DIRECT_MIN else bytes)
        assert await conn.reply() == 7  # the reply after it was not swallowed
    if split is not None and n >= wire._DIRECT_MIN:
        assert split.recvs > 5  # it really came in pieces


@pytest.mark.parametrize("sizes", [None, (1,)], ids=["whole", "bytewise"])
async def test_wire_bulk_reply_error_and_nil_go_to_hiredis(sizes: tuple[int, ...] | None) -> None:
    stream = b"-WRONGTYPE Operation against a key\r\n$-1\r\n" + _bulk(b"x" * wire._DIRECT_MIN)
    async with _wire_conn(stream, sizes) as (conn, _):
        err = await conn.bulk_reply()
        assert type(err) is rexc.ResponseError and "WRONGTYPE" in str(err)
        assert await conn.bulk_reply() is None
        assert await conn.bulk_reply() == b"x" * wire._DIRECT_MIN


@pytest.mark.parametrize(
    "stream",
    [
        b"$70000\r\n" + b"x" * 70_000 + b"XY",  # no CRLF after the payload
        b"$70000\r\n" + b"x" * 1000,  # the server hangs up part-way
        b"$12345678901234567890123456789\r\n",  # a header too long to be one
    ],
    ids=["bad-terminator", "closed-mid-value", "long-header"],
)
async def test_wire_bulk_reply_bad_stream_is_a_connection_error(stream: bytes) -> None:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    a.setblocking(False)
    conn = wire.WireConnection(a, loop)
    try:
        b.sendall(stream)  # fits the socket buffer
        b.shutdown(socket.SHUT_WR)
        with pytest.raises(rexc.ConnectionError):
            async with asyncio.timeout(10):
                await conn.bulk_reply()
    finally:
        conn.close()
        b.close()


async def test_redis_wire_get_around_the_direct_threshold(
    redis_pair: tuple[RedisStore, aioredis.Redis, str],
) -> None:
    """Against the real server: values either side of the threshold come back whole."""
    store, client, prefix = redis_pair
    pool = store.wire_pool
    assert pool is not None
    for n in (wire._DIRECT_MIN - 1, wire._DIRECT_MIN, wire._DIRECT_MIN + 1, (5 << 20) + 3):
        payload = os.urandom(n)
        await client.set(f"{prefix}raw-{n}", payload, px=60_000)
        assert await wire.get(pool, f"{prefix}raw-{n}".encode()) == payload
    assert await wire.get(pool, f"{prefix}absent".encode()) is None
    assert pool.opened == 1


# --- redis+cluster: keys spread by slot, the cluster's name, a deaf channel ---------------


@pytest.fixture
async def cluster_store(redis_cluster: Any) -> AsyncIterator[Any]:
    from runtime.stores.redis_cluster import RedisClusterStore

    tag = uuid.uuid4().hex[:12]
    store = RedisClusterStore(f"{redis_cluster.url}?key_prefix=test-{tag}:")
    try:
        yield store, tag
    finally:
        await store.close()
        redis_cluster.delete(f"test-{tag}:*")


async def test_cluster_store_spreads_keys_over_every_master(
    redis_cluster: Any, cluster_store: Any
) -> None:
    store, tag = cluster_store
    keys = [f"ec:fp:{uuid.uuid4().hex}" for _ in range(60)]
    await asyncio.gather(*(store.put(k, torch.full((4,), float(i))) for i, k in enumerate(keys)))
    per_master = redis_cluster.keys_per_master(f"test-{tag}:*")
    print(f"\ncluster store keys per master: {per_master}")
    assert len(per_master) == 3 and all(n > 0 for n in per_master.values()), per_master
    assert sum(per_master.values()) == 60
    got = await store.get_many(keys)  # one MGET per slot, in the order asked
    assert [int(t[0]) for t in got] == list(range(60))
    await store.wait(keys, timeout_s=5)


def test_cluster_store_url_names_the_cluster_not_one_node(redis_cluster: Any) -> None:
    from runtime.stores.redis_cluster import RedisClusterStore

    seeds = [a.replace("127.0.0.1", "LOCALHOST-X") for a in redis_cluster.nodes.addresses]
    a = RedisClusterStore(
        "redis+cluster://user:secret@"
        + ",".join(reversed(redis_cluster.nodes.addresses))
        + "?key_prefix=p:&socket_timeout=3"
    )
    b = RedisClusterStore(
        "redis+cluster://" + ",".join(redis_cluster.nodes.addresses) + "?key_prefix=p:"
    )
    assert a.url == b.url  # any seed order, credentials and timeouts left out
    assert "secret" not in a.url and "socket_timeout" not in a.url
    assert all(addr in a.url for addr in redis_cluster.nodes.addresses)
    assert a.url.startswith("redis+cluster://") and a.url.endswith("?key_prefix=p:")
    assert "localhost-x" in RedisClusterStore("redis+cluster://" + ",".join(seeds)).url
    with pytest.raises(ValueError, match="HOST:PORT"):
        RedisClusterStore("redis+cluster://127.0.0.1:notaport")
    with pytest.raises(ValueError, match="database 0"):
        RedisClusterStore("redis+cluster://127.0.0.1:7000/3")


async def test_cluster_store_unreachable_is_unavailable() -> None:
    from runtime.stores.redis_cluster import RedisClusterStore

    store = RedisClusterStore(
        f"redis+cluster://127.0.0.1:{_closed_port()}", socket_connect_timeout_s=0.5
    )
    try:
        with pytest.raises(StoreUnavailable):
            await store.put("k", torch.ones(1))
        with pytest.raises(StoreUnavailable):
            await store.get("k")
        with pytest.raises(StoreUnavailable):
            await store.wait(["k"], timeout_s=5)
    finally:
        await store.close()


async def test_cluster_store_wait_fails_promptly_when_its_master_drops_the_subscription(
    redis_cluster: Any, cluster_store: Any
) -> None:
    """The sharded subscription's connection is killed while a wait depends on it: the wait
    fails with StoreUnavailable at once (the consume loop retries), not after its timeout; the
    next wait subscribes afresh and is woken by a put."""
    import redis.asyncio as aioredis_

    store, _ = cluster_store
    waiter = asyncio.create_task(store.wait(["never"], timeout_s=30))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    killed = 0
    for addr in redis_cluster.masters():
        host, port = addr.rsplit(":", 1)
        node = aioredis_.Redis(host=host, port=int(port))
        try:
            killed += int(await node.execute_command("CLIENT", "KILL", "TYPE", "pubsub"))
        finally:
            await node.aclose()
    assert killed >= 1
    with pytest.raises(StoreUnavailable, match="readiness"):
        await asyncio.wait_for(waiter, 10)
    again = asyncio.create_task(store.wait(["later"], timeout_s=30))
    await asyncio.sleep(0.3)
    await store.put("later", torch.ones(1))
    await asyncio.wait_for(again, 10)
