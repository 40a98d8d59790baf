"""The ``stores`` section of ``bench/gpu.py`` (and its device timing helpers): put/get of one
1369x1536 bf16 embedding made on the device, through ``cuda://`` (same process, and another
process over CUDA IPC), ``shm://`` and ``redis://`` (a throwaway ``redis-server`` on a free port
when one is on PATH). On CPU (the dry run) ``cuda://`` runs in its CPU test mode.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
EMBED_SHAPE = (1369, 1536)  # a 1024² image on Qwen2-VL-2B: 37x37 merged tokens, hidden 1536


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def p50_ms(samples: list[float]) -> float:
    s = sorted(samples)
    return round(s[len(s) // 2] * 1e3, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis() -> tuple[subprocess.Popen[bytes] | None, str | None, str | None]:
    """A throwaway ``redis-server`` on a free port: (process, url, reason when skipped)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None, "skipped: redis-server is not on PATH"
    try:
        import redis  # noqa: F401
    except ImportError as exc:
        return None, None, f"skipped: redis-py missing ({exc})"
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0", None
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None, None, "skipped: redis-server did not start"


async def store_times(url: str, emb: torch.Tensor, repeat: int, cpu_seam: bool) -> dict[str, Any]:
    """put (from the device tensor) and get (back onto the device) of ``emb``, p50 ms."""
    from runtime.stores import open_store
    from runtime.stores.cuda import CudaStore

    store = CudaStore(url, device=emb.device) if cpu_seam else open_store(url)
    dev = emb.device
    try:
        puts, gets = [], []
        for i in range(repeat + 2):
            key = f"bench-{i}"
            sync(dev)
            t0 = time.perf_counter()
            await store.put(key, emb, ttl_s=120)
            sync(dev)
            t1 = time.perf_counter()
            got = (await store.get(key)).to(dev, non_blocking=False)
            sync(dev)
            t2 = time.perf_counter()
            if i >= 2:
                puts.append(t1 - t0)
                gets.append(t2 - t1)
            if i == 0 and not torch.equal(got, emb):
                raise AssertionError(f"{url}: the value read back differs")
            await store.delete(key)
        return {"put_p50_ms": p50_ms(puts), "get_p50_ms": p50_ms(gets), "n": repeat}
    finally:
        await store.close()


READER_TIMEOUT_S = 180.0
"""How long the reader process may take before it is killed (with its CUDA context)."""

CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path.insert(0, {root!r})
    from bench.gpu_stores import reader_report
    print(json.dumps(asyncio.run(reader_report({url!r}, {repeat}))))
    """
)


async def read_times(store: Any, repeat: int, sync: Callable[[], None]) -> dict[str, Any]:
    """The reader's side of the cross-process leg, on an open store: wait for ``ready``, then
    time ``repeat`` gets of ``emb``. Nothing is read before the first timed get, so it is the
    one that opens the producer's chunk (``ready`` lives in the same chunk: reading it first
    would leave only warm reads to time); ``ready`` is read last, to check the bytes."""
    await store.wait(["ready"], 120)
    times: list[float] = []
    got = None
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        got = await store.get("emb")
        sync()
        times.append(time.perf_counter() - t0)
    want = await store.get("ready")
    equal = got is not None and bool(torch.equal(got, want))
    return {"times": times, "equal": equal, "device": str(getattr(got, "device", None))}


async def reader_report(url: str, repeat: int) -> dict[str, Any]:
    """What the reader process prints (its main, kept here so a test can run it)."""
    from runtime.stores import open_store

    store = open_store(url)
    try:
        return await read_times(store, repeat, torch.cuda.synchronize)
    finally:
        await store.close()


async def run_child(argv: list[str], timeout_s: float) -> tuple[int, bytes, bytes]:
    """Run ``argv`` to its end: (exit status, stdout, stderr). One that outlives ``timeout_s``
    (or whose wait is cancelled) is killed and reaped, so it leaves no CUDA context behind."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"reader process still running after {timeout_s:g} s: killed") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return int(proc.returncode or 0), out, err


async def cuda_cross_process(url: str, emb: torch.Tensor, repeat: int) -> dict[str, Any]:
    """Another process opens our entry over CUDA IPC: its get time (the first get, which opens
    the chunk, apart), and that the bytes match."""
    from runtime.stores import open_store

    store = open_store(url)
    try:
        await store.put("emb", emb, ttl_s=120)
        await store.put("ready", emb, ttl_s=120)
        code = CHILD.format(root=str(ROOT), url=url, repeat=repeat)
        rc, out, err = await run_child([sys.executable, "-c", code], READER_TIMEOUT_S)
        if rc != 0:
            raise RuntimeError(f"reader process failed: {err.decode()[-2000:]}")
        rep = json.loads(out.decode().strip().splitlines()[-1])
        return {
            "get_p50_ms": p50_ms(rep["times"][1:]),
            "first_get_ms_opens_chunk": round(rep["times"][0] * 1e3, 4),
            "equal": rep["equal"],
            "device": rep["device"],
            "n": repeat - 1,
        }
    finally:
        await store.close()


async def section_stores(device: torch.device, repeat: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(EMBED_SHAPE, generator=gen).to(device=device, dtype=torch.bfloat16)
    tag = uuid.uuid4().hex[:10]
    out: dict[str, Any] = {
        "shape": list(EMBED_SHAPE),
        "dtype": "bfloat16",
        "mib": round(emb.numel() * 2 / 2**20, 3),
    }
    cuda_url = f"cuda://epd-bench-{tag}"
    shm_url = f"shm://epd-bench-{tag}"
    cpu_seam = device.type != "cuda"
    runs: list[tuple[str, Callable[[], Any]]] = [
        ("cuda_same_process", lambda: store_times(cuda_url, emb, repeat, cpu_seam)),
        ("shm", lambda: store_times(shm_url, emb, repeat, False)),
    ]
    if not cpu_seam:
        runs.append(("cuda_cross_process", lambda: cuda_cross_process(cuda_url, emb, repeat + 1)))
    redis_proc, redis_url, why = start_redis()
    try:
        if redis_url:
            runs.append(("redis", lambda: store_times(redis_url, emb, repeat, False)))
        else:
            out["redis"] = why
        for name, run in runs:
            try:
                out[name] = await run()
            except Exception as exc:
                out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()
        for d in (f"epd-bench-{tag}.cuda-index", f"epd-bench-{tag}"):
            shutil.rmtree(f"/dev/shm/{d}", ignore_errors=True)
    out["note"] = (
        "put starts from a device tensor and get ends on the device, so shm:// and "
        "redis:// include the device<->host copies; cuda:// stays on the device"
    )
    return out
