"""The OpenAI-compatible stream: time to first token and per output token as a client sees
them, and what streaming costs, side by side in one run.

One pipeline (results, encode and prefill worker processes, ``epd api``), tiny model on CPU;
``REQUESTS`` chat completions (text + one image, ``MAX_TOKENS`` new tokens, greedy,
``ignore_eos``) sent at once through ``POST /v1/chat/completions``, in four cells, each run
``ROUNDS`` times alternating (the best round reported; every request has an image of its own):

1. ``streamed``: ``stream: true``; per request, from the client's clock: time to first token
   (sent -> first content chunk), time per output token ((last chunk - first chunk) / (tokens -
   1)), chunks, latency; p50/p99, and tokens/s over the cell's wall time.
2. ``plain``: the same requests not streamed (the workers still write token streams).
3. ``plain_no_stream_writes``: the prefill worker restarted with ``EPD_STREAM_TOKENS=false``,
   the requests not streamed: the pipeline without any streaming.
4. ``streamed_no_stream_writes``: streamed on that worker: the answer arrives whole at the end
   (what streaming buys a client: its time to first token).

The streaming cost is (1)'s tokens/s over (3)'s; the yardstick is (3), in the same run. The
decode benchmark's ``api`` block reads the same tokens straight from Redis (``ttft``/``tpot``
there): the difference is the API's relay. No budget in docs/design.md: figures only.

Needs Kafka (``EPD_KAFKA_BOOTSTRAP``) and Redis (DB 11, keys under one ``bench-...`` prefix,
deleted afterwards, as are the run's topics).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from bench.api_process import ApiProcess, image_b64
from bench.common import quantile, sig
from bench.pipeline import _cleanup_redis, _delete_topics, pipeline_settings

REQUESTS = 8
MAX_TOKENS = 128
ROUNDS = 2
"""Each cell runs once per round (streamed and plain in turn first), each round with the
prefill worker's stream writes on and then off, after a warm-up cell on each new worker; the
best round of each cell is reported."""


def _stats(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": sig(quantile(samples, 0.5)), "p99_ms": sig(quantile(samples, 0.99))}


def _body(i: int, max_tokens: int, stream: bool) -> dict[str, Any]:
    """Request ``i``: its own image (``i`` differs across cells too: every request encodes)."""
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Story {i}: once upon a time"},
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/png;base64,{image_b64(3000 + i)}"},
                    },
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


async def _streamed(http: httpx.AsyncClient, i: int, max_tokens: int) -> dict[str, float]:
    """One streamed completion, timed from the client's side."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=_body(i, max_tokens, True)) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream {i} failed: {chunk['error']}")
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    done = time.perf_counter()
    if not stamps or tokens != max_tokens:
        raise RuntimeError(f"stream {i}: {len(stamps)} chunks, {tokens} tokens")
    return {
        "ttft_ms": (stamps[0] - t0) * 1000,
        "tpot_ms": (stamps[-1] - stamps[0]) * 1000 / max(tokens - 1, 1),
        "latency_ms": (done - t0) * 1000,
        "chunks": len(stamps),
    }


async def _plain(http: httpx.AsyncClient, i: int, max_tokens: int) -> dict[str, float]:
    t0 = time.perf_counter()
    r = await http.post("/v1/chat/completions", json=_body(i, max_tokens, False))
    r.raise_for_status()
    if r.json()["usage"]["completion_tokens"] != max_tokens:
        raise RuntimeError(f"request {i}: {r.json()['usage']}")
    return {"latency_ms": (time.perf_counter() - t0) * 1000}


async def _cell(
    http: httpx.AsyncClient, stream: bool, n: int, max_tokens: int, first: int
) -> dict[str, Any]:
    """``n`` requests at once (numbered from ``first``): tokens/s over the wall, per-request
    figures."""
    one = _streamed if stream else _plain
    t0 = time.perf_counter()
    rows = await asyncio.gather(*(one(http, first + i, max_tokens) for i in range(n)))
    wall = time.perf_counter() - t0
    out: dict[str, Any] = {
        "tokens_per_s": sig(n * max_tokens / wall),
        "wall_ms": sig(wall * 1000),
        "latency": _stats([r["latency_ms"] for r in rows]),
    }
    if stream:
        out["ttft"] = _stats([r["ttft_ms"] for r in rows])
        if all(r["chunks"] > 1 for r in rows):  # one chunk (the whole answer): no pace
            out["tpot"] = _stats([r["tpot_ms"] for r in rows])
        out["chunks_per_request"] = sig(sum(r["chunks"] for r in rows) / n)
    return out


async def _run(
    settings: Any, log_dir: Path, n: int, max_tokens: int, rounds: int
) -> dict[str, Any]:
    from epd.local_pipeline import WorkerProcesses, worker_env
    from runtime.kafka import ensure_topics
    from schemas.topics import Topics

    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings, topics.all())
    env = worker_env(settings)
    workers = WorkerProcesses(env, log_dir, ("results", "encode", "prefill"))
    workers.start()
    api = ApiProcess(env, log_dir / "api.log")
    cells: dict[str, list[dict[str, Any]]] = {}
    try:
        await asyncio.gather(workers.wait_ready(), api.ready())
        async with httpx.AsyncClient(base_url=api.url, timeout=300) as http:
            first = 0
            for r in range(rounds):
                for writes in (True, False):
                    if r or not writes:
                        await _stream_writes(workers, writes)
                    # warm-up of each (new) worker: model pages, batch shapes, the encoder
                    await _cell(http, False, n, max_tokens, first)
                    first += n
                    suffix = "" if writes else "_no_stream_writes"
                    order = ((True, "streamed"), (False, "plain"))
                    for stream, name in order if r % 2 == 0 else order[::-1]:
                        cell = await _cell(http, stream, n, max_tokens, first)
                        cells.setdefault(name + suffix, []).append(cell)
                        first += n
    finally:
        api.stop()
        workers.stop()
        await _delete_topics(settings, topics.all())
    # the best round of each cell: the least disturbed by the shared machine
    return {name: max(runs, key=lambda c: c["tokens_per_s"]) for name, runs in cells.items()}


async def _stream_writes(workers: Any, on: bool) -> None:
    """Restart the prefill worker with ``EPD_STREAM_TOKENS`` on or off."""
    [prefill] = [i for i in workers.indices("prefill") if i not in workers.retired]
    workers.retire(prefill)
    workers.env["EPD_STREAM_TOKENS"] = "true" if on else "false"
    await workers.add("prefill")


def run(
    *, quick: bool = False, out: Path | None = None, redis_url: str | None = None
) -> dict[str, Any]:
    """The four cells side by side; the report block (figures only)."""
    settings, prefix = pipeline_settings(redis_url)
    log_dir = (out / "openai-logs") if out else Path(tempfile.mkdtemp(prefix="bench-openai-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = settings.model_copy(
        update={
            "topic_prefix": f"{prefix}-{uuid.uuid4().hex[:6]}",
            "ec_namespace": f"ec-{prefix}",
            "ec_secret": SecretStr(secrets.token_hex(16)),
        }
    )
    n, tokens, rounds = (2, 8, 1) if quick else (REQUESTS, MAX_TOKENS, ROUNDS)
    try:
        cells = asyncio.run(_run(settings, log_dir, n, tokens, rounds))
    finally:
        asyncio.run(_cleanup_redis(settings.redis_url, prefix))
    streamed, bare = cells["streamed"], cells["plain_no_stream_writes"]
    return {
        "model": "tiny, CPU, greedy; one prefill worker process; POST /v1/chat/completions",
        "requests": n,
        "max_tokens": tokens,
        **cells,
        "streaming_cost": {
            "tokens_per_s_streamed": streamed["tokens_per_s"],
            "tokens_per_s_without_streaming": bare["tokens_per_s"],
            "ratio": sig(streamed["tokens_per_s"] / bare["tokens_per_s"]),
            "ttft_p50_ms_streamed": streamed["ttft"]["p50_ms"],
            "ttft_p50_ms_whole_answer": cells["streamed_no_stream_writes"]["ttft"]["p50_ms"],
        },
        "worker_logs": str(log_dir),
    }
