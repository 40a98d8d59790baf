"""Decode bombs against the HTTP API: what a refused bomb costs afterwards, and what text-only
requests wait during an attack (issue 27, defect 1).

``python -m bench.api_decode_bombs`` starts two ``epd api`` processes (no workers: every request
here is refused or only accepted) against ``EPD_KAFKA_BOOTSTRAP`` / ``EPD_REDIS_URL`` or services
of its own, and sends progressive JPEGs whose last scan repeats thousands of times
(:func:`media.sample_images.repeated_scan_jpeg`, 4096x4096, ~200 KB):

- ``lifted``: the structure guard lifted (``EPD_MAX_IMAGE_SCANS`` huge), renders cut at
  ``--render-timeout`` seconds, so the bomb reaches the decoder: the answer to one bomb and the
  API's CPU seconds (process and children) in the ``--after`` seconds that follow; then
  ``--bombs`` bombs sent two at a time while a text-only request goes every 0.5 s, and the
  text requests' acceptance latency;
- ``default``: the deployment's limits: the answer to one bomb and how long it took.

One JSON object on stdout. Loopback only; every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.api_process import ApiProcess
from bench.api_soak import _services
from bench.common import machine_facts, production_broker


def bomb_body(scans: int) -> dict[str, Any]:
    from media.sample_images import repeated_scan_jpeg

    data = repeated_scan_jpeg(4096, scans)
    return {"prompt": "<image>", "images": [base64.b64encode(data).decode()], "max_tokens": 1}


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and everything under it."""
    root = psutil.Process(pid)
    total = 0.0
    for p in [root, *root.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


async def post(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        r = await http.post("/v1/requests", json=body)
        rule = r.json().get("error", {}).get("rule") if r.status_code >= 400 else None
        return {"status": r.status_code, "rule": rule, "s": round(time.monotonic() - t0, 3)}
    except httpx.HTTPError as e:
        return {"status": None, "rule": type(e).__name__, "s": round(time.monotonic() - t0, 3)}


async def refusal_cost(api: ApiProcess, body: dict[str, Any], after_s: float) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, timeout=180) as http:
        answer = await post(http, body)
        start = tree_cpu_s(api.proc.pid)
        await asyncio.sleep(after_s)
        return {"answer": answer, "cpu_s_after": round(tree_cpu_s(api.proc.pid) - start, 3)}


async def attack(api: ApiProcess, body: dict[str, Any], bombs: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=api.url, timeout=180) as http:
        done = asyncio.Event()

        async def pairs() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            for _ in range(0, bombs, 2):
                out += await asyncio.gather(post(http, body), post(http, body))
            done.set()
            return out

        async def texts() -> list[dict[str, Any]]:
            out: list[dict[str, Any]] = []
            await asyncio.sleep(0.5)
            while not done.is_set() and len(out) < 400:
                out.append(await post(http, {"prompt": "text only", "max_tokens": 1}))
                await asyncio.sleep(0.5)
            return out

        bomb_answers, text_answers = await asyncio.gather(pairs(), texts())
    latencies = sorted(a["s"] for a in text_answers)
    return {
        "bombs": [f"{a['status']} {a['rule']}" for a in bomb_answers],
        "text_requests": len(latencies),
        "text_accepted": sum(a["status"] == 202 for a in text_answers),
        "text_latency_s": {
            "p50": round(statistics.median(latencies), 3) if latencies else None,
            "max": latencies[-1] if latencies else None,
        },
    }


async def run(opts: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from pydantic import SecretStr

    from epd.local_pipeline import worker_env
    from runtime.kafka import ensure_topics
    from runtime.settings import Settings
    from schemas.topics import Topics

    prefix = f"bombs-{uuid.uuid4().hex[:8]}"
    settings = Settings().model_copy(
        update={"topic_prefix": prefix, "ec_secret": SecretStr(secrets.token_hex(16))}
    )
    await ensure_topics(settings, Topics(prefix).all())
    # No workers run here: readiness must not wait for them (EPD_READY_STAGES empty).
    env = {**worker_env(settings), "EPD_LOG_LEVEL": "WARNING", "EPD_READY_STAGES": ""}
    env.pop("EPD_API_TOKENS", None)
    body = bomb_body(opts.scans)
    lifted_env = {
        **env,
        "EPD_MAX_IMAGE_SCANS": "100000000",
        "EPD_MAX_IMAGE_CHUNKS": "100000000",
        "EPD_API_RENDER_TIMEOUT_S": str(opts.render_timeout),
    }
    out: dict[str, Any] = {"bomb_bytes": len(body["images"][0]) * 3 // 4, "scans": opts.scans}
    for name, api_env in (("lifted", lifted_env), ("default", env)):
        api = ApiProcess(api_env, log_dir / f"api-{name}.log")
        try:
            await api.ready()
            if name == "lifted":
                out[name] = {
                    "refusal": await refusal_cost(api, body, opts.after),
                    "attack": await attack(api, body, opts.bombs),
                }
            else:
                async with httpx.AsyncClient(base_url=api.url, timeout=180) as http:
                    out[name] = {"answer": await post(http, body)}
        finally:
            api.stop()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    production_broker()
    p = argparse.ArgumentParser(prog="python -m bench.api_decode_bombs", description=__doc__)
    p.add_argument("--scans", type=int, default=6000, help="repeats of the bomb's last scan")
    p.add_argument("--render-timeout", type=float, default=10.0)
    p.add_argument("--after", type=float, default=15.0, help="seconds CPU is measured after")
    p.add_argument("--bombs", type=int, default=6)
    opts = p.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="api-bombs-"))
    with _services():
        result = asyncio.run(run(opts, log_dir))
    result["machine"] = machine_facts()
    result["logs"] = str(log_dir)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
