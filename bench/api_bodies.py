"""Big legal bodies at once: the API's memory and ``/healthz`` latency while N clients each
send a body just under ``EPD_API_MAX_BODY_BYTES`` (issue 27, defect 4).

``python -m bench.api_bodies --bodies 60 --mb 31.5 --rounds 2`` starts one ``epd api``
process (tiny model, CPU; no workers: every body is refused before the pipeline, 413
``request.prompt`` for what it holds, or 503 ``body.budget`` past the body budget) against
``EPD_KAFKA_BOOTSTRAP`` / ``EPD_REDIS_URL`` (or services of its own), on loopback only. Each
of the ``--bodies`` clients sends ``--rounds`` bodies one after the other over raw sockets
(it stops sending when the server answers early, as a client reading the answer does).
Meanwhile ``/healthz`` is timed every ``--probe-every`` seconds and the API's RSS sampled
from ``/proc``. stdout gets one JSON document: RSS at rest, its peak and growth (MiB),
``/healthz`` latency (p50, p90, max ms, and probes that failed), the answers by status and
rule, and the wall time. Run it on two checkouts to compare them (the yardstick is the same
load on the previous code).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import secrets
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.api_soak import _services, _spawn_api, _until_ready
from bench.common import machine_facts, production_broker, quantile, sig
from bench.worker_profile import rss_mb

MB = 1024 * 1024
CHUNK = 256 * 1024


@dataclass
class Options:
    bodies: int
    body_bytes: int
    rounds: int
    route: str
    probe_every_s: float


@dataclass
class Observed:
    """What the run saw: answers, ``/healthz`` latencies, RSS samples."""

    answers: Counter[str] = field(default_factory=Counter)
    healthz_ms: list[float] = field(default_factory=list)
    healthz_failed: int = 0
    rss_mb: list[float] = field(default_factory=list)


def body_of(route: str, size: int) -> bytes:
    """A legal JSON body of ``size`` bytes whose one text is far over the prompt limit."""
    if route == "chat":
        head = b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        tail = b'"}]}'
    else:
        head, tail = b'{"prompt": "', b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


async def send(port: int, path: str, body: bytes) -> str:
    """POST ``body`` and read the answer (the upload stops once it comes, as a client reading
    it does); the answer's ``status rule``, or the error that ended the exchange."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()

    async def upload() -> None:
        with contextlib.suppress(ConnectionError):
            writer.write(head)
            view = memoryview(body)
            for i in range(0, len(body), CHUNK):
                writer.write(view[i : i + CHUNK])
                await writer.drain()

    sender = asyncio.create_task(upload())
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
        length = next(
            (
                int(h.split(b":")[1])
                for h in raw.split(b"\r\n")
                if h.lower().startswith(b"content-length:")
            ),
            0,
        )
        raw += await reader.readexactly(length)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender
        writer.close()
    status = raw.split(b" ", 2)[1].decode() if raw.startswith(b"HTTP/") else "no-answer"
    rule = ""
    with contextlib.suppress(ValueError, KeyError, TypeError):
        err = json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]
        rule = err.get("rule") or err.get("code") or ""
    return f"{status} {rule}".strip()


def probe(url: str, obs: Observed, pid: int, every_s: float, stop: threading.Event) -> None:
    """Time ``/healthz`` and sample the API's RSS until ``stop`` is set (in a thread of its
    own, blocking: the senders' event loop does not delay the probes)."""
    import httpx

    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            probe_once(http, url, obs, pid)
            stop.wait(every_s)


def probe_once(http: Any, url: str, obs: Observed, pid: int) -> None:
    """One RSS sample and one timed ``/healthz``."""
    import httpx

    rss = rss_mb(pid)
    if rss is not None:
        obs.rss_mb.append(rss)
    t0 = time.perf_counter()
    try:
        ok = http.get(f"{url}/healthz").status_code == 200
    except httpx.HTTPError:
        ok = False
    if ok:
        obs.healthz_ms.append((time.perf_counter() - t0) * 1000)
    else:
        obs.healthz_failed += 1


async def drive(url: str, pid: int, opts: Options) -> dict[str, Any]:
    path = "/v1/chat/completions" if opts.route == "chat" else "/v1/requests"
    body = body_of(opts.route, opts.body_bytes)
    port = int(url.rsplit(":", 1)[1])
    obs = Observed()
    rest = rss_mb(pid) or 0.0
    rest_probe = Observed()
    import httpx

    with httpx.Client(timeout=60) as http:
        for _ in range(10):  # /healthz at rest, the yardstick
            probe_once(http, url, rest_probe, pid)
    stop = threading.Event()

    async def client() -> None:
        for _ in range(opts.rounds):
            obs.answers[await send(port, path, body)] += 1

    watcher = threading.Thread(target=probe, args=(url, obs, pid, opts.probe_every_s, stop))
    watcher.start()
    t0 = time.monotonic()
    try:
        await asyncio.gather(*(client() for _ in range(opts.bodies)))
    finally:
        wall = time.monotonic() - t0
        stop.set()
        watcher.join()
    lat = obs.healthz_ms or [float("nan")]
    return {
        "bench": "api_bodies",
        "machine": machine_facts(),
        "options": {
            "bodies": opts.bodies,
            "body_mb": sig(opts.body_bytes / MB),
            "rounds": opts.rounds,
            "route": path,
        },
        "rss_mb": {
            "at_rest": sig(rest),
            "peak": sig(max(obs.rss_mb, default=rest)),
            "growth": sig(max(obs.rss_mb, default=rest) - rest),
        },
        "healthz_ms": {
            "at_rest_p50": sig(quantile(rest_probe.healthz_ms or [float("nan")], 0.5)),
            "p50": sig(quantile(lat, 0.5)),
            "p90": sig(quantile(lat, 0.9)),
            "max": sig(max(lat)),
            "probes": len(obs.healthz_ms),
            "failed": obs.healthz_failed,
        },
        "answers": dict(sorted(obs.answers.items())),
        "wall_s": sig(wall),
    }


async def run_bench(opts: Options, log_dir: Path) -> dict[str, Any]:
    """One ``epd api`` on services of the environment, driven by :func:`drive`."""
    from pydantic import SecretStr

    from epd.local_pipeline import worker_env
    from runtime.kafka import ensure_topics
    from runtime.settings import Settings
    from schemas.topics import Topics

    prefix = f"api-bodies-{uuid.uuid4().hex[:8]}"
    settings = Settings().model_copy(
        update={
            "topic_prefix": prefix,
            "ec_namespace": f"ec-{prefix}",
            "ec_secret": SecretStr(secrets.token_hex(16)),
            "model": "tiny",
            "device": "cpu",
        }
    )
    await ensure_topics(settings, Topics(prefix).all())
    env = {**worker_env(settings), "EPD_LOG_LEVEL": "WARNING"}
    api, url = _spawn_api(env, log_dir / "api.log")
    try:
        await _until_ready(api, url)
        return await drive(url, api.pid, opts)
    finally:
        api.terminate()
        try:
            api.wait(30)
        except Exception:
            api.kill()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; JSON to stdout."""
    production_broker()
    p = argparse.ArgumentParser(
        prog="python -m bench.api_bodies", description=__doc__.split("\n")[0]
    )
    p.add_argument("--bodies", type=int, default=60, help="clients sending at once")
    p.add_argument("--mb", type=float, default=31.5, help="MiB per body (legal: under 32)")
    p.add_argument("--rounds", type=int, default=2, help="bodies each client sends in turn")
    p.add_argument("--route", choices=("requests", "chat"), default="requests")
    p.add_argument("--probe-every", type=float, default=0.05, help="seconds between probes")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    opts = Options(a.bodies, int(a.mb * MB), a.rounds, a.route, a.probe_every)
    log_dir = Path(tempfile.mkdtemp(prefix="api-bodies-"))
    with _services():
        result = asyncio.run(run_bench(opts, log_dir))
    result["logs"] = str(log_dir)
    text = json.dumps(result, indent=2)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0 if not result["healthz_ms"]["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
