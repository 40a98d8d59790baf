"""API soak: the HTTP front door under a mixed load of 1,000+ requests, watching memory.

``python -m bench.api_soak --requests 1200 --concurrency 8`` starts the results, encode and
prefill workers and one ``epd api`` process (tiny model, CPU) against ``EPD_KAFKA_BOOTSTRAP`` /
``EPD_REDIS_URL`` (or services of its own, started for the run), on a topic prefix of its own,
and sends requests the way users and attackers did in issue 21: image requests (new images and
repeats, followed by long-poll or by the event stream), text-only ones, vLLM render responses,
cancels, and refusals (oversized metadata, deeply nested JSON, NaN, bad base64, a huge PNG
header). Every ``--sample-every`` requests it samples the RSS of the API process and of the
results collector (``/proc/<pid>/status``) and Redis ``used_memory``; stdout gets one JSON
summary: growth from the first sample after ``--warmup`` requests to the last (MB and %) and a
verdict per process, ``flat`` when that growth is under ``--flat-pct`` percent.

Status records (``EPD_STATUS_TTL_S``) and embeddings (``EPD_EMBEDDING_TTL_S``) legitimately
accumulate in Redis until their TTLs; the processes' memory should not.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine_facts, production_broker, sig
from bench.worker_profile import rss_mb
from schemas.statuses import TERMINAL_STATUSES

MB = 1024 * 1024
TOKEN = "soak-token"


@dataclass
class Tally:
    """Outcomes of the requests sent so far, by kind and answer."""

    sent: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)


class Traffic:
    """One request of the mix at a time (seeded: the same run sends the same requests)."""

    def __init__(self, seed: int = 0) -> None:
        from media.sample_images import png_bytes, synthetic_image

        self.rng = random.Random(seed)
        self._png = lambda s, side=56: png_bytes(synthetic_image(side, side, seed=s))
        self.repeats = [self._data_url(self._png(s)) for s in range(4)]
        self.next_seed = 50_000

    @staticmethod
    def _data_url(data: bytes) -> str:
        return f"data:image/png;base64,{base64.b64encode(data).decode()}"

    def image(self) -> str:
        if self.rng.random() < 0.3:
            return self.rng.choice(self.repeats)
        self.next_seed += 1
        return self._data_url(self._png(self.next_seed))

    def kind(self) -> str:
        r = self.rng.random()
        for bound, name in ((0.5, "image"), (0.6, "text"), (0.7, "vllm"), (0.8, "cancel")):
            if r < bound:
                return name
        return "refused"


async def _follow(http: Any, rid: str, stream: bool) -> str:
    """Wait for the outcome by the event stream or by long-polls; returns the status."""
    if stream:
        status, kind = "", ""
        async with http.stream("GET", f"/v1/requests/{rid}/events", timeout=120) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:") and kind != "token":  # tokens carry no status
                    status = json.loads(line[5:])["status"]
        return status
    for _ in range(20):
        body = (await http.get(f"/v1/requests/{rid}", params={"wait": 30}, timeout=60)).json()
        if body["status"] in TERMINAL_STATUSES:
            return str(body["status"])
    return "unfinished"


async def _one(http: Any, traffic: Traffic, vllm: dict[str, Any], tally: Tally) -> None:
    kind = traffic.kind()
    tally.sent += 1
    try:
        if kind == "refused":
            answer = await _refused(http, traffic)
        elif kind == "vllm":
            r = await http.post("/v1/vllm/generate", json=vllm)
            answer = (
                await _follow(http, r.json()["request_id"], False)
                if r.status_code == 202
                else str(r.status_code)
            )
        else:
            body: dict[str, Any] = {"prompt": f"Soak {tally.sent}", "max_tokens": 4}
            if kind != "text":
                body = {"prompt": "Soak <image>", "images": [traffic.image()], "max_tokens": 4}
            r = await http.post(
                "/v1/requests", json=body, headers={"Idempotency-Key": uuid.uuid4().hex}
            )
            if r.status_code != 202:
                answer = str(r.status_code)
            elif kind == "cancel":
                answer = str(
                    (await http.delete(f"/v1/requests/{r.json()['request_id']}")).status_code
                )
            else:
                answer = await _follow(http, r.json()["request_id"], stream=tally.sent % 2 == 0)
        tally.answers[f"{kind}:{answer}"] += 1
    except Exception as exc:  # counted: one bad request must not end the soak
        tally.errors[f"{kind}: {type(exc).__name__}: {str(exc)[:100]}"] += 1


async def _refused(http: Any, traffic: Traffic) -> str:
    """One of the inputs issue 21 found; the answer's status code."""
    choice = traffic.rng.randrange(5)
    if choice == 0:
        r = await http.post("/v1/requests", json={"prompt": "x", "metadata": {"k": "v" * MB}})
    elif choice == 1:
        nested = '{"prompt": "x", "metadata": ' + '{"a":' * 3000 + "1" + "}" * 3000 + "}"
        r = await http.post(
            "/v1/requests", content=nested, headers={"content-type": "application/json"}
        )
    elif choice == 2:
        r = await http.post(
            "/v1/requests",
            content=b'{"prompt": "x", "temperature": NaN}',
            headers={"content-type": "application/json"},
        )
    elif choice == 3:
        r = await http.post("/v1/requests", json={"prompt": "<image>", "images": ["/etc/passwd"]})
    else:
        r = await http.post("/v1/requests", json={"prompt": "x", "cache_salt": "s" * 200_000})
    return str(r.status_code)


def _vllm_body() -> dict[str, Any]:
    from media.sample_images import synthetic_image
    from producers.render import Renderer
    from runtime.model import load_render_info
    from schemas.vllm_wire import GenerateRequest, generate_request_to_json

    ev = Renderer(load_render_info("tiny"), max_image_pixels=1 << 24).render(
        "soak-vllm", prompt="vLLM <image>", images=[synthetic_image(56, 56, seed=3)]
    )
    req = GenerateRequest(
        token_ids=ev.token_ids,
        features=ev.features,
        sampling_params={"max_tokens": 4, "temperature": 0},
        request_id="soak-vllm",
    )
    return dict(generate_request_to_json(req))


@dataclass(frozen=True, slots=True)
class Options:
    requests: int
    concurrency: int
    sample_every: int
    warmup: int
    flat_pct: float


async def _drive(
    api_url: str, pids: dict[str, int], redis_url: str, opts: Options
) -> dict[str, Any]:
    import httpx
    import redis.asyncio as aioredis

    traffic, tally, vllm = Traffic(), Tally(), _vllm_body()
    samples: list[dict[str, Any]] = []
    client = aioredis.Redis.from_url(redis_url)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    t0 = time.perf_counter()

    async def sample() -> None:
        info = await client.info("memory")
        rss_now = {name: rss_mb(pid) for name, pid in pids.items()}
        s = {
            "requests": tally.sent,
            "t_s": sig(time.perf_counter() - t0),
            "rss_mb": rss_now,
            "redis_used_memory_mb": sig(int(info["used_memory"]) / MB),
        }
        samples.append(s)
        rss = " ".join(f"{k}={v:.0f}" for k, v in rss_now.items() if v is not None)
        redis_mb = s["redis_used_memory_mb"]
        print(
            f"api-soak n={tally.sent} t={s['t_s']}s rss_mb[{rss}] redis_mb={redis_mb}",
            file=sys.stderr,
            flush=True,
        )

    try:
        async with httpx.AsyncClient(base_url=api_url, headers=headers, timeout=60) as http:
            await sample()
            slots = asyncio.Semaphore(opts.concurrency)

            async def guarded() -> None:
                async with slots:
                    await _one(http, traffic, vllm, tally)

            while tally.sent < opts.requests:
                batch = min(opts.sample_every, opts.requests - tally.sent)
                await asyncio.gather(*(guarded() for _ in range(batch)))
                await sample()
    finally:
        await client.aclose()
    return _summary(samples, tally, opts)


def _summary(samples: list[dict[str, Any]], tally: Tally, opts: Options) -> dict[str, Any]:
    base = next((s for s in samples if s["requests"] >= opts.warmup), samples[0])
    last = samples[-1]

    def growth(name: str) -> dict[str, Any]:
        first, end = base["rss_mb"][name], last["rss_mb"][name]
        if first is None or end is None:
            return {"verdict": "unknown"}
        pct = 100 * (end - first) / first
        peak = max(s["rss_mb"][name] or 0 for s in samples)
        return {
            "start_mb": sig(first),
            "end_mb": sig(end),
            "peak_mb": sig(peak),
            "growth_mb": sig(end - first),
            "growth_pct": sig(pct),
            "verdict": "flat" if pct < opts.flat_pct else "growing",
        }

    processes = {name: growth(name) for name in last["rss_mb"]}
    return {
        "machine": machine_facts(),
        "options": asdict(opts),
        "growth_window_requests": [base["requests"], last["requests"]],
        "requests": {
            "sent": tally.sent,
            "answers": dict(tally.answers),
            "errors": dict(tally.errors.most_common(5)),
        },
        "processes": processes,
        "verdicts": {name: g["verdict"] for name, g in processes.items()},
        "redis_used_memory_mb": [samples[0]["redis_used_memory_mb"], last["redis_used_memory_mb"]],
        "samples": samples,
    }


async def _soak(opts: Options, log_dir: Path) -> dict[str, Any]:
    from pydantic import SecretStr

    from epd.local_pipeline import WorkerProcesses, worker_env
    from runtime.kafka import ensure_topics
    from runtime.settings import Settings
    from schemas.topics import Topics

    prefix = f"api-soak-{uuid.uuid4().hex[:8]}"
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
    env = {**worker_env(settings), "EPD_API_TOKENS": f"{TOKEN}=soak", "EPD_LOG_LEVEL": "WARNING"}
    with WorkerProcesses(env, log_dir, ("results", "encode", "prefill")) as workers:
        api, url = _spawn_api(env, log_dir / "api.log")
        try:
            await _until_ready(api, url)
            await workers.wait_ready()
            pids = {"api": api.pid, "results-collector": workers.procs[0][1].pid}
            return await _drive(url, pids, settings.redis_url, opts)
        finally:
            api.send_signal(signal.SIGTERM)
            try:
                api.wait(30)
            except subprocess.TimeoutExpired:
                api.kill()


def _spawn_api(env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``epd api`` on a free port (not ready yet: see :func:`_until_ready`)."""
    from epd.local_pipeline import child_env
    from epd.services import free_port

    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epd.cli", "api", "--port", str(port)],
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, f"http://127.0.0.1:{port}"


async def _until_ready(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 150) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"epd api exited with {proc.returncode} (see its log)")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    return
            await asyncio.sleep(0.25)
    raise TimeoutError("epd api not ready (see its log)")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one API soak; the summary JSON goes to stdout, one line per sample to stderr."""
    production_broker()
    p = argparse.ArgumentParser(prog="python -m bench.api_soak", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=1200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--warmup", type=int, default=300, help="requests before growth is measured")
    p.add_argument("--flat-pct", type=float, default=5.0, help="growth below this %% is flat")
    p.add_argument("--out", type=Path, default=None, help="also write the summary here")
    a = p.parse_args(argv)
    opts = Options(a.requests, a.concurrency, a.sample_every, a.warmup, a.flat_pct)
    log_dir = Path(tempfile.mkdtemp(prefix="api-soak-"))
    with _services():
        summary = asyncio.run(_soak(opts, log_dir))
    summary["logs"] = str(log_dir)
    text = json.dumps(summary, indent=2)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 0 if summary["requests"]["sent"] and not summary["requests"]["errors"] else 1


@contextlib.contextmanager
def _services() -> Any:
    """The broker and Redis the environment names, or ones of this run's own."""
    if os.environ.get("EPD_KAFKA_BOOTSTRAP") and os.environ.get("EPD_REDIS_URL"):
        yield
        return
    from epd import services

    with services.running() as state:
        os.environ.update(state.env)
        yield


if __name__ == "__main__":
    sys.exit(main())
