"""Embedding-store throughput: redis:// vs redis-benchmark, shm:// get bandwidth, local:// latency.

Redis: ``open_store("redis://HOST:PORT/11?key_prefix=bench-<uuid>:")`` does N sequential puts
then N sequential gets of one 1 MiB / 4 MiB tensor (our blob is a 64-byte header + the raw
bytes), on one connection. The yardstick is ``redis-benchmark -t set,get -d SIZE -n N -c 1``
against the same server and DB: one client, no pipelining, so both sides do the same thing and
the ratio isolates our client + store overhead. The third column is redis-py + hiredis (a bare
``redis.asyncio`` SET/GET of the same bytes, hiredis parsing its replies): the library path our
own wire client (``runtime/stores/redis_wire.py``: hiredis-parsed too, except GET values of
64 KiB or more, received straight into their own buffer) is compared against, side by side.
Throughput is value bytes moved per second (MB/s, 10^6). The sides run in interleaved rounds
(ours, redis-py + hiredis, redis-benchmark; 3 rounds in a full run) and each side's MB/s is the
median over rounds, so a neighbour's burst of load on a shared machine hits all alike.

shm: ``get`` returns a tensor viewing an ``mmap`` of the file, so a get alone moves no data;
the budgeted number is get + ``copy_`` into a preallocated tensor (every byte read once, as a
consumer that moves the embedding to a device must), in GB/s, beside the same ``copy_`` from a
tensor already in memory (the ceiling). The view-only get latency is reported too.

local: the in-process store hands tensors over by reference; put/get latency for reference.

Scale-out (``scale_out``): several clients at once, each its own process
(``bench/store_clients.py``), doing N sequential puts, then N sequential gets, of its own keys,
all from one common start; aggregate MB/s = all their bytes / (start to the last one's end).
Side by side on: ``redis://`` (the server above, our wire client), and ``redis+cluster://``
clusters this benchmark starts itself (no replicas, no persistence, 127.0.0.1) with 1 and with
3 masters (the cluster store: redis-py's ``RedisCluster`` for the slot map, the wire client to
each master for the data), and the 3 masters once more with redis-py alone for the data
(``cluster_3_masters_redis_py``). On a machine with few cores, the servers and the clients
share them: a second and third master can only add what idle cores allow.

Keys live under a unique prefix (Redis DB 11) or directory and are deleted afterwards, including
the one key ``redis-benchmark`` writes (``key:__rand_int__`` in DB 11).
"""

from __future__ import annotations

import asyncio
import csv
import io
import shutil
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch
from redis.utils import HIREDIS_AVAILABLE

from bench.common import Stats, budget, headroom, measure, measure_async, ratio, sig
from bench.store_clients import leg

REDIS_DB = 11
MIB = 1 << 20
MAX_REDIS_RATIO = 1.5
MIN_SHM_GB_S = 5.0
BENCHMARK_KEY = "key:__rand_int__"
"""The only key ``redis-benchmark -t set,get`` touches when run without ``-r``."""


def _redis_target(redis_url: str) -> tuple[str, int, str | None]:
    parts = urlsplit(redis_url)
    return parts.hostname or "127.0.0.1", parts.port or 6379, parts.password


def store_url(redis_url: str, prefix: str) -> str:
    """Our ``redis://`` store URL on the same server as ``redis_url``: DB 11, ``prefix`` keys."""
    host, port, password = _redis_target(redis_url)
    auth = f":{password}@" if password else ""
    return f"redis://{auth}{host}:{port}/{REDIS_DB}?key_prefix={prefix}"


def redis_benchmark(redis_url: str, size: int, n: int) -> dict[str, float] | None:
    """``redis-benchmark -t set,get -d size -n n -c 1`` in DB 11: requests/s per test.

    None when the tool is not installed.
    """
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    host, port, password = _redis_target(redis_url)
    cmd = [exe, "-h", host, "-p", str(port), "--dbnum", str(REDIS_DB)]
    if password:
        cmd += ["-a", password]
    cmd += ["-t", "set,get", "-d", str(size), "-n", str(n), "-c", "1", "-q", "--csv"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    rps: dict[str, float] = {}
    for row in csv.reader(io.StringIO(done.stdout)):
        if len(row) >= 2 and row[0] in ("SET", "GET"):
            rps[row[0]] = float(row[1])
    if set(rps) != {"SET", "GET"}:
        raise RuntimeError(f"unexpected redis-benchmark output: {done.stdout!r} {done.stderr!r}")
    return rps


def _throughput(stats: Stats, size: int) -> dict[str, Any]:
    """Latency stats plus MB/s from the mean op time (what a rate over N ops measures)."""
    return {**stats.to_json("ms"), "mb_s": sig(size / stats.mean / 1e6)}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


async def _redis_sizes(
    redis_url: str, prefix: str, sizes: list[int], n: int, rounds: int
) -> dict[str, Any]:
    """Per size, ``rounds`` interleaved rounds of: our put/get, redis-py + hiredis SET/GET and
    redis-benchmark, ``n`` ops each. Interleaving spreads a noisy neighbour's load over all
    sides; MB/s is the median over rounds and the ratio compares those medians."""
    import redis.asyncio as aioredis

    from runtime.stores import open_store

    store = open_store(store_url(redis_url, prefix))
    host, port, password = _redis_target(redis_url)
    raw = aioredis.Redis(host=host, port=port, password=password, db=REDIS_DB)
    out: dict[str, Any] = {}
    try:
        for size in sizes:
            tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
            payload = tensor.numpy().tobytes()
            key = f"value-{size}"
            raw_key = f"{prefix}raw-{size}"

            async def put(key: str = key, tensor: torch.Tensor = tensor) -> None:
                await store.put(key, tensor, ttl_s=300)

            async def get(key: str = key) -> torch.Tensor:
                return await store.get(key)

            async def raw_set(k: str = raw_key, payload: bytes = payload) -> None:
                await raw.set(k, payload, px=300_000)

            async def raw_get(k: str = raw_key) -> Any:
                return await raw.get(k)

            samples: dict[str, list[float]] = {}
            mb_s: dict[str, list[float]] = {}
            for _ in range(rounds):
                for label, fn in (
                    ("ours_put", put),
                    ("ours_get", get),
                    ("redis_py_hiredis_set", raw_set),
                    ("redis_py_hiredis_get", raw_get),
                ):
                    st = await measure_async(fn, n)
                    samples.setdefault(label, []).extend(st.samples)
                    mb_s.setdefault(label, []).append(size / st.mean / 1e6)
                rb = await asyncio.to_thread(redis_benchmark, redis_url, size, n)
                if rb is not None:
                    mb_s.setdefault("rb_set", []).append(rb["SET"] * size / 1e6)
                    mb_s.setdefault("rb_get", []).append(rb["GET"] * size / 1e6)
            if not torch.equal(await get(), tensor):
                raise AssertionError(f"redis store returned different bytes for {size}")
            await store.delete(key)
            await raw.delete(raw_key)
            entry: dict[str, Any] = {"ops_per_round": n, "rounds": rounds}
            for label in ("ours_put", "ours_get", "redis_py_hiredis_set", "redis_py_hiredis_get"):
                entry[label] = {
                    **Stats(samples[label]).to_json("ms"),
                    "mb_s": sig(_median(mb_s[label])),
                    "mb_s_rounds": [sig(x) for x in mb_s[label]],
                }
            # Advantage of our wire path over the library path (> 1: ours is faster).
            entry["speedup_vs_redis_py_hiredis"] = {
                "put": ratio(_median(mb_s["ours_put"]), _median(mb_s["redis_py_hiredis_set"])),
                "get": ratio(_median(mb_s["ours_get"]), _median(mb_s["redis_py_hiredis_get"])),
            }
            if "rb_set" in mb_s:
                rb_set, rb_get = _median(mb_s["rb_set"]), _median(mb_s["rb_get"])
                entry["redis_benchmark"] = {
                    "set_mb_s": sig(rb_set),
                    "get_mb_s": sig(rb_get),
                    "set_mb_s_rounds": [sig(x) for x in mb_s["rb_set"]],
                    "get_mb_s_rounds": [sig(x) for x in mb_s["rb_get"]],
                }
                entry["ratio_put"] = ratio(rb_set, _median(mb_s["ours_put"]))
                entry["ratio_get"] = ratio(rb_get, _median(mb_s["ours_get"]))
            out[f"{size // MIB}MiB"] = entry
    finally:
        await store.close()
        await raw.delete(BENCHMARK_KEY)
        await raw.aclose()
    return out


async def _shm_sizes(sizes: list[int], n: int) -> dict[str, Any]:
    from runtime.stores import open_store

    name = f"epd-bench-{uuid.uuid4().hex[:12]}"
    store: Any = open_store(f"shm://{name}")
    out: dict[str, Any] = {}
    try:
        for size in sizes:
            tensor = torch.randint(0, 256, (size // 2,), dtype=torch.int16).view(torch.bfloat16)
            dst = torch.empty_like(tensor)
            key = f"value-{size}"

            async def put(key: str = key, tensor: torch.Tensor = tensor) -> None:
                await store.put(key, tensor, ttl_s=300)

            async def get_view(key: str = key) -> torch.Tensor:
                return await store.get(key)

            async def get_read(key: str = key, dst: torch.Tensor = dst) -> torch.Tensor:
                return dst.copy_(await store.get(key))

            puts = await measure_async(put, n)
            views = await measure_async(get_view, n)
            reads = await measure_async(get_read, n)

            # The ceiling: the same copy from a tensor already in process memory.
            def copy(dst: torch.Tensor = dst, tensor: torch.Tensor = tensor) -> torch.Tensor:
                return dst.copy_(tensor)

            memcpy = measure(copy, n)
            if not torch.equal(dst.view(torch.int16), tensor.view(torch.int16)):
                raise AssertionError(f"shm store returned different bytes for {size}")
            await store.delete(key)
            out[f"{size // MIB}MiB"] = {
                "ops": n,
                "put": _throughput(puts, size),
                "get_view_only": views.to_json("us"),
                "get_and_read": {
                    **reads.to_json("ms"),
                    "gb_s": sig(size / reads.p50 / 1e9),
                },
                "memcpy": {**memcpy.to_json("ms"), "gb_s": sig(size / memcpy.p50 / 1e9)},
                "get_and_read_vs_memcpy": ratio(reads.p50, memcpy.p50),
            }
    finally:
        await store.close()
        directory = getattr(store, "directory", None)
        if isinstance(directory, Path) and directory.name == name:
            shutil.rmtree(directory, ignore_errors=True)
    return out


async def _local(n: int) -> dict[str, Any]:
    from runtime.stores import open_store

    store = open_store(f"local://bench-{uuid.uuid4().hex[:12]}")
    tensor = torch.zeros(4 * MIB // 2, dtype=torch.bfloat16)
    try:
        puts = await measure_async(lambda: store.put("value", tensor, ttl_s=300), n)
        gets = await measure_async(lambda: store.get("value"), n)
        await store.delete("value")
    finally:
        await store.close()
    return {"put_4MiB": puts.to_json("us"), "get_4MiB": gets.to_json("us")}


def _scale_out(
    redis_url: str, prefix: str, sizes: list[int], n: int, client_counts: list[int]
) -> dict[str, Any]:
    """The scale-out legs (see the module docstring), targets interleaved within each cell."""
    import tempfile

    from epd.services import start_redis_cluster
    from epd.services.local_redis_cluster import stop_redis_cluster

    root = Path(tempfile.mkdtemp(prefix="bench-clusters-"))
    clusters = {m: start_redis_cluster(root / f"m{m}", m) for m in (1, 3)}
    targets = {
        "redis": (store_url(redis_url, prefix), "default"),
        "cluster_1_master": (f"{clusters[1].url}?key_prefix={prefix}", "default"),
        "cluster_3_masters": (f"{clusters[3].url}?key_prefix={prefix}", "default"),
        "cluster_3_masters_redis_py": (f"{clusters[3].url}?key_prefix={prefix}", "redis-py"),
    }
    out: dict[str, Any] = {"servers": {k: v[0].split("?")[0] for k, v in targets.items()}}
    try:
        for size in sizes:
            for clients in client_counts:
                cell: dict[str, Any] = {}
                for name, (url, io) in targets.items():
                    phases = leg(url, size, n, clients, f"s{size}-c{clients}-{name}", io)
                    put, get = phases["put"], phases["get"]
                    cell[name] = {
                        "put_mb_s": sig(put["mb_s"]),
                        "get_mb_s": sig(get["mb_s"]),
                        "per_client_put_mb_s": [sig(x) for x in put["per_client_mb_s"]],
                        "per_client_get_mb_s": [sig(x) for x in get["per_client_mb_s"]],
                    }
                for op in ("put", "get"):
                    three = cell["cluster_3_masters"][f"{op}_mb_s"]
                    cell[f"{op}_3_vs_1_masters"] = ratio(
                        three, cell["cluster_1_master"][f"{op}_mb_s"]
                    )
                    cell[f"{op}_cluster_3_vs_redis"] = ratio(three, cell["redis"][f"{op}_mb_s"])
                out.setdefault(f"{size // MIB}MiB", {})[f"{clients}_clients"] = cell
    finally:
        for c in clusters.values():
            stop_redis_cluster(c)
        shutil.rmtree(root, ignore_errors=True)
    out["ops_per_client"] = n
    return out


def run(
    *, quick: bool = False, out: Path | None = None, redis_url: str | None = None
) -> dict[str, Any]:
    """Measure the three stores and return the report block."""
    if redis_url is None:
        from runtime.settings import Settings

        redis_url = Settings().redis_url
    redis_sizes = [1 * MIB] if quick else [1 * MIB, 4 * MIB]
    redis_n, rounds = (10, 1) if quick else (60, 3)
    shm_sizes = [4 * MIB] if quick else [4 * MIB, 16 * MIB]
    shm_n = 5 if quick else 50
    t0 = time.perf_counter()
    prefix = f"bench-{uuid.uuid4().hex[:12]}:"
    redis_res = asyncio.run(_redis_sizes(redis_url, prefix, redis_sizes, redis_n, rounds))
    shm_res = asyncio.run(_shm_sizes(shm_sizes, shm_n))
    local_res = asyncio.run(_local(20 if quick else 200))
    scale = _scale_out(
        redis_url,
        prefix,
        [1 * MIB] if quick else [1 * MIB, 4 * MIB],
        4 if quick else 30,
        [1] if quick else [1, 4],  # quick: one client process per target (the same legs)
    )

    has_rb = all("redis_benchmark" in r for r in redis_res.values())
    worst_redis = (
        max(max(r["ratio_put"], r["ratio_get"]) for r in redis_res.values()) if has_rb else None
    )
    worst_shm = min(r["get_and_read"]["gb_s"] for r in shm_res.values())
    meets = (worst_redis is not None and worst_redis <= MAX_REDIS_RATIO) and (
        worst_shm >= MIN_SHM_GB_S
    )
    room = {"shm_get_gb_s": headroom(worst_shm, MIN_SHM_GB_S, higher_is_better=True)}
    if worst_redis is not None:
        room["redis_vs_redis_benchmark"] = headroom(
            worst_redis, MAX_REDIS_RATIO, higher_is_better=False
        )
    return {
        "headroom": room,
        "redis_server": "{}:{}/{}".format(*_redis_target(redis_url)[:2], REDIS_DB),
        "redis_key_prefix": prefix,
        "redis_benchmark_available": has_rb,
        "redis_py_uses_hiredis": HIREDIS_AVAILABLE,
        "redis": redis_res,
        "shm": shm_res,
        "local": local_res,
        "scale_out": scale,
        "redis_worst_ratio": worst_redis,
        "shm_min_gb_s": worst_shm,
        "elapsed_s": sig(time.perf_counter() - t0),
        "budget": budget(
            "Redis store get/put within 1.5x of redis-benchmark for the same value size "
            "(ratio = redis-benchmark MB/s / ours, one client each, worst of put/get and "
            "sizes; not met when redis-benchmark is missing); shm get >= 5 GB/s (get + read "
            "every byte once, p50, worst size)",
            max_redis_ratio=MAX_REDIS_RATIO,
            min_shm_gb_s=MIN_SHM_GB_S,
        ),
        "meets_budget": meets,
    }
