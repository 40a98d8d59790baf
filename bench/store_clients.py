"""Several store clients at once, as separate processes (``bench/stores.py``'s scale-out legs).

``python -m bench.store_clients URL SIZE N TAG [IO]``: one client. It opens the store at
``URL`` (``IO`` ``redis-py``: a cluster store on redis-py alone, without the wire client),
warms its connections with one put and get, and then, for each phase (``put``, then ``get``):
says ``ready`` on stdout, waits for ``go`` on stdin (the leg sends it to every client at once,
when all are ready), runs ``N`` sequential operations of a ``SIZE``-byte tensor under keys
``TAG-0..N-1`` and prints one JSON line: when it started and ended (epoch seconds) and the
bytes it moved. Separate processes, so clients do not share one interpreter lock: what is
measured is the stores, as far as the machine's cores allow.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
PHASES = ("put", "get")


async def _client(url: str, size: int, n: int, tag: str, io: str) -> None:
    from runtime.stores import open_store
    from runtime.stores.redis_cluster import RedisClusterStore

    store = RedisClusterStore(url, wire_io=False) if io == "redis-py" else open_store(url)
    tensor = torch.randint(0, 256, (size,), dtype=torch.uint8)
    keys = [f"{tag}-{i}" for i in range(n)]
    try:
        await store.put(f"{tag}-warm", tensor, ttl_s=300)
        await store.get(f"{tag}-warm")
        for phase in PHASES:
            print("ready", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # "go"
            started = time.time()
            for key in keys:
                if phase == "put":
                    await store.put(key, tensor, ttl_s=300)
                elif (await store.get(key)).numel() != size:
                    raise AssertionError(f"{key}: not {size} bytes")
            ended = time.time()
            print(json.dumps({"started": started, "ended": ended, "bytes": n * size}), flush=True)
        for key in [*keys, f"{tag}-warm"]:
            await store.delete(key)
    finally:
        await store.close()


def _phase(procs: list[subprocess.Popen[str]]) -> dict[str, Any]:
    """Wait until every client is ready, say go to all, collect their reports."""
    for p in procs:
        assert p.stdout is not None
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"store client exited {p.wait()} before it was ready")
    go = time.time()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"store client exited {p.wait()} mid-phase")
        results.append(json.loads(line))
    wall = max(r["ended"] for r in results) - go
    return {
        "mb_s": sum(r["bytes"] for r in results) / wall / 1e6,
        "per_client_mb_s": sorted(r["bytes"] / (r["ended"] - r["started"]) / 1e6 for r in results),
    }


def leg(
    url: str, size: int, n: int, clients: int, tag: str, io: str = "default"
) -> dict[str, dict[str, Any]]:
    """``clients`` processes doing ``n`` puts, then ``n`` gets, each phase from one common go:
    per phase, aggregate MB/s (all their bytes / from the go to the last one's end) and the
    per-client MB/s."""
    argv = [sys.executable, "-m", "bench.store_clients", url, str(size), str(n)]
    procs = [
        subprocess.Popen(
            [*argv, f"{tag}-c{c}", io],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for c in range(clients)
    ]
    try:
        out = {phase: _phase(procs) for phase in PHASES}
        for p in procs:
            if p.wait(timeout=120) != 0:
                raise RuntimeError(f"store client exited {p.returncode}")
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def main(argv: list[str]) -> int:
    url, size, n, tag, *io = argv
    asyncio.run(_client(url, int(size), int(n), tag, io[0] if io else "default"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
