"""Soak: the real pipeline under a steady request rate, watching memory for growth.

``python -m bench.soak --minutes N --rps R`` (also ``python -m bench soak ...``, ``make soak``)
spawns the results, encode, prefill and router workers with ``local_pipeline`` (tiny model,
CPU) against ``EPD_KAFKA_BOOTSTRAP`` and ``EPD_REDIS_URL`` (DB 11, every key under one
``soak-...`` prefix, deleted afterwards) and submits requests at a fixed rate, each with one
image: mostly new images (the encoder runs), some repeats of a small pool (encoder-cache hits),
and some large enough that their pixels exceed ``EPD_INLINE_LIMIT_BYTES`` and travel as claim
checks, which the encode worker deletes once the embedding is stored.

Every interval (a minute by default; shorter for runs under six minutes) one line goes to
stderr: the RSS of each worker process (``/proc/<pid>/status`` VmRSS), the broker's RSS (the
process listening on the bootstrap port, or ``--broker-pid``), Redis ``used_memory`` and this
run's keys by kind, requests sent/completed/failed in the interval, and the interval's p50/p99
end-to-end latency (render start to the client seeing the terminal status record, polled every
5 ms). At the end stdout gets one JSON summary: growth per worker from the end of the warm-up
to the last sample (MB and %), and a verdict per worker: ``flat`` when that growth is under
``--flat-pct`` percent, else ``growing``.

Redis ``used_memory`` is the whole server's (other clients included), and embeddings (TTL
``EPD_EMBEDDING_TTL_S``) and status records (``EPD_STATUS_TTL_S``) legitimately accumulate
until their TTLs; the key counts separate those from claim checks, which should stay near zero.
The in-memory Tansu broker keeps every record it is sent, so its RSS grows with traffic by
design.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import machine_facts, production_broker, quantile, sig
from bench.pipeline import REDIS_DB, _cleanup_redis, _delete_topics, _redis_db_url, render_request
from bench.worker_profile import rss_mb
from schemas.status_record import StatusRecord

KINDS = ("results", "encode", "prefill", "router")
SMALL_SIDE = 56
"""Tiny-model image with 16 patches (~75 KB of fp32 pixels): travels inline."""
LARGE_SIDE = 224
"""Tiny-model image with 1.2 MB of fp32 pixels: above the default 256 KiB inline limit."""
POLL_S = 0.005
REQUEST_TIMEOUT_S = 120.0
REPEAT_POOL = 4
DEFAULT_FLAT_PCT = 5.0
MB = 1024 * 1024


# ---------------------------------------------------------------------------------------------
# Memory probes


def _listen_inodes(port: int) -> set[str]:
    """Socket inodes listening on TCP ``port`` (IPv4 and IPv6), from /proc/net/tcp*."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN.
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    return inodes


def listener_pid(port: int) -> int | None:
    """The pid of the local process listening on ``port`` (None when not found or not ours).

    When that process is Docker's port proxy, the container's main process is looked up
    instead (``docker ps --filter publish=PORT`` then its ``State.Pid``).
    """
    inodes = _listen_inodes(port)
    if not inodes:
        return None
    wanted = {f"socket:[{i}]" for i in inodes}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in wanted:
                        pid = int(proc.name)
                        if (proc / "comm").read_text().strip() == "docker-proxy":
                            return _container_pid(port)
                        return pid
    return None


def _container_pid(port: int) -> int | None:
    """Main pid of the container publishing ``port`` (None without a docker CLI that answers)."""
    import subprocess

    try:
        ids = subprocess.run(
            ["docker", "ps", "-q", "--filter", f"publish={port}"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.split()
        if not ids:
            return None
        out = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Pid}}", ids[0]],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return int(out) or None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def bootstrap_port(bootstrap: str) -> int:
    """The port of the first ``host:port`` in a bootstrap list."""
    return int(bootstrap.split(",")[0].rsplit(":", 1)[1])


# ---------------------------------------------------------------------------------------------
# Load


@dataclass
class Counters:
    """Request outcomes, cumulative and for the current interval."""

    sent: int = 0
    completed: int = 0
    failed: int = 0
    window_sent: int = 0
    window_completed: int = 0
    window_failed: int = 0
    window_latency_ms: list[float] = field(default_factory=list)
    all_latency_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    claim_checked: int = 0
    repeats: int = 0

    def take_window(self) -> dict[str, Any]:
        """The interval's counts and latency quantiles; starts a new interval."""
        lat = self.window_latency_ms
        out = {
            "sent": self.window_sent,
            "completed": self.window_completed,
            "failed": self.window_failed,
            "p50_ms": sig(quantile(lat, 0.5)) if lat else None,
            "p99_ms": sig(quantile(lat, 0.99)) if lat else None,
        }
        self.window_sent = self.window_completed = self.window_failed = 0
        self.window_latency_ms = []
        return out


class ImageMix:
    """New and repeated synthetic images, some above the inline limit (seeded: reproducible)."""

    def __init__(self, repeat_fraction: float, large_fraction: float, seed: int = 0) -> None:
        from media.sample_images import synthetic_image

        self._make = synthetic_image
        self.rng = random.Random(seed)
        self.repeat_fraction = repeat_fraction
        self.large_fraction = large_fraction
        self.next_seed = 10_000
        self.pool = [synthetic_image(SMALL_SIDE, SMALL_SIDE, s) for s in range(REPEAT_POOL)]

    def pick(self) -> tuple[Any, bool, bool]:
        """``(image, repeated, large)``."""
        if self.rng.random() < self.repeat_fraction:
            return self.rng.choice(self.pool), True, False
        large = self.rng.random() < self.large_fraction
        side = LARGE_SIDE if large else SMALL_SIDE
        self.next_seed += 1
        return self._make(side, side, self.next_seed), False, large


async def _await_terminal(run: Any, request_id: str) -> StatusRecord:
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while time.monotonic() < deadline:
        rec = await run.submitter.status.get(request_id)
        if rec is not None and rec.terminal:
            return rec
        await asyncio.sleep(POLL_S)
    raise TimeoutError(f"not finished after {REQUEST_TIMEOUT_S:g}s")


async def _one_request(run: Any, image: Any, salt: str, c: Counters) -> None:
    """Render, submit and wait for one request; count its outcome and latency."""
    t0 = time.perf_counter()
    try:
        ev = await render_request(run, image, salt)
        await run.submitter.submit_rendered(ev)
        rec = await _await_terminal(run, ev.request_id)
        if rec.status != "completed":
            raise RuntimeError(f"{rec.status}: {rec.error}")
    except Exception as exc:  # counted and reported: one bad request must not end the soak
        c.failed += 1
        c.window_failed += 1
        c.errors[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
        return
    ms = (time.perf_counter() - t0) * 1000
    c.completed += 1
    c.window_completed += 1
    c.window_latency_ms.append(ms)
    c.all_latency_ms.append(ms)


# ---------------------------------------------------------------------------------------------
# Samples


@dataclass(frozen=True, slots=True)
class Options:
    """One soak's shape."""

    duration_s: float
    rps: float
    interval_s: float
    warmup_s: float
    repeat_fraction: float
    large_fraction: float
    flat_pct: float
    broker_pid: int | None


async def _redis_sample(client: Any, prefix: str) -> dict[str, Any]:
    """Server ``used_memory`` and this run's keys by kind (claim checks, store, status)."""
    info = await client.info("memory")
    kinds: Counter[str] = Counter()
    async for key in client.scan_iter(match=f"{prefix}*", count=1000):
        k = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
        if ":claim:" in k:
            kinds["claim"] += 1
        elif k.startswith(f"{prefix}:"):
            kinds["store"] += 1  # embeddings (the store's key prefix)
        else:
            kinds["status"] += 1  # status records and the like (the topic prefix)
    return {
        "used_memory_mb": sig(int(info["used_memory"]) / MB),
        "keys": {k: kinds.get(k, 0) for k in ("claim", "store", "status")},
    }


def _growth(first: float | None, last: float | None, flat_pct: float) -> dict[str, Any]:
    if first is None or last is None:
        return {"verdict": "unknown"}
    mb = last - first
    pct = 100 * mb / first if first else 0.0
    return {
        "start_mb": sig(first),
        "end_mb": sig(last),
        "growth_mb": sig(mb),
        "growth_pct": sig(pct),
        "verdict": "flat" if pct < flat_pct else "growing",
    }


def _line(s: dict[str, Any]) -> str:
    w = s["requests"]
    rss = " ".join(f"{k}={v:.0f}" for k, v in s["rss_mb"].items() if v is not None)
    broker = None if s["broker_rss_mb"] is None else round(s["broker_rss_mb"])
    keys = s["redis"]["keys"]
    return (
        f"soak t={s['t_s']:>6.0f}s rss_mb[{rss}] broker_mb={broker} "
        f"redis_mb={s['redis']['used_memory_mb']} keys(claim={keys['claim']} store={keys['store']} "
        f"status={keys['status']}) sent={w['sent']} completed={w['completed']} "
        f"failed={w['failed']} p50_ms={w['p50_ms']} p99_ms={w['p99_ms']}"
    )


async def _soak(settings: Any, opts: Options, log_dir: Path, prefix: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from epd.local_pipeline import local_pipeline
    from schemas.topics import Topics

    run_settings = None
    redis_client = aioredis.Redis.from_url(settings.redis_url)
    broker_pid = opts.broker_pid or listener_pid(bootstrap_port(settings.kafka_bootstrap))
    samples: list[dict[str, Any]] = []
    c = Counters()
    mix = ImageMix(opts.repeat_fraction, opts.large_fraction)
    salt = uuid.uuid4().hex
    t_start = time.perf_counter()
    try:
        async with local_pipeline(
            settings, spawn_workers=True, log_dir=log_dir, kinds=KINDS
        ) as run:
            run_settings = run.settings
            startup_s = time.perf_counter() - t_start
            assert run.workers is not None
            pids = {f"{k}-{i}": p.pid for i, (k, p, _) in enumerate(run.workers.procs)}
            pids["driver"] = os.getpid()

            async def sample(t_s: float) -> dict[str, Any]:
                s = {
                    "t_s": sig(t_s),
                    "rss_mb": {name: rss_mb(pid) for name, pid in pids.items()},
                    "broker_rss_mb": rss_mb(broker_pid),
                    "redis": await _redis_sample(redis_client, prefix),
                    "requests": c.take_window(),
                    "total": {"sent": c.sent, "completed": c.completed, "failed": c.failed},
                }
                samples.append(s)
                print(_line(s), file=sys.stderr, flush=True)
                return s

            await sample(0.0)
            tasks: set[asyncio.Task[None]] = set()
            t0 = time.monotonic()
            next_send, next_sample = t0, t0 + opts.interval_s
            end = t0 + opts.duration_s
            while (now := time.monotonic()) < end:
                if now >= next_send:
                    image, repeated, large = mix.pick()
                    c.sent += 1
                    c.window_sent += 1
                    c.repeats += repeated
                    c.claim_checked += large
                    task = asyncio.create_task(_one_request(run, image, salt, c))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    next_send += 1 / opts.rps
                if now >= next_sample:
                    run.workers.check_alive()
                    await sample(now - t0)
                    next_sample += opts.interval_s
                await asyncio.sleep(max(0.0, min(next_send, next_sample, end) - time.monotonic()))
            if tasks:  # let the last requests finish (they belong to the final interval)
                await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S)
            run.workers.check_alive()
            await sample(time.monotonic() - t0)
    finally:
        await _cleanup_redis(settings.redis_url, prefix)
        await redis_client.aclose()
        if run_settings is not None:
            await _delete_topics(run_settings, Topics(run_settings.topic_prefix).all())
    return _summary(samples, c, opts, startup_s, broker_pid, log_dir, prefix)


def _summary(
    samples: list[dict[str, Any]],
    c: Counters,
    opts: Options,
    startup_s: float,
    broker_pid: int | None,
    log_dir: Path,
    prefix: str,
) -> dict[str, Any]:
    """Growth from the first sample at or after the warm-up to the last sample."""
    base = next((s for s in samples if s["t_s"] >= opts.warmup_s), samples[-1])
    if base is samples[-1] and len(samples) > 1:
        base = samples[-2]  # a run shorter than its warm-up still compares two samples
    last = samples[-1]
    workers = {
        name: _growth(base["rss_mb"][name], last["rss_mb"][name], opts.flat_pct)
        for name in last["rss_mb"]
    }
    redis_first, redis_last = base["redis"], last["redis"]
    return {
        "machine": machine_facts(),
        "options": {
            "duration_s": opts.duration_s,
            "rps": opts.rps,
            "interval_s": sig(opts.interval_s),
            "warmup_s": sig(opts.warmup_s),
            "repeat_fraction": opts.repeat_fraction,
            "large_fraction": opts.large_fraction,
            "image_sides": {"small": SMALL_SIDE, "large": LARGE_SIDE},
            "kinds": list(KINDS),
        },
        "flat_threshold_pct": opts.flat_pct,
        "growth_window_s": [base["t_s"], last["t_s"]],
        "startup_s": sig(startup_s),
        "requests": {
            "sent": c.sent,
            "completed": c.completed,
            "failed": c.failed,
            "repeated_images": c.repeats,
            "claim_checked_images": c.claim_checked,
            "errors": dict(c.errors.most_common(5)),
            "p50_ms": sig(quantile(c.all_latency_ms, 0.5)) if c.all_latency_ms else None,
            "p99_ms": sig(quantile(c.all_latency_ms, 0.99)) if c.all_latency_ms else None,
        },
        "workers": workers,
        "verdicts": {name: g["verdict"] for name, g in workers.items()},
        "broker": {"pid": broker_pid, **_growth(base["broker_rss_mb"], last["broker_rss_mb"], 1e9)}
        | {"verdict": "reported only: the in-memory broker keeps every record"},
        "redis": {
            "used_memory_start_mb": redis_first["used_memory_mb"],
            "used_memory_end_mb": redis_last["used_memory_mb"],
            "used_memory_growth_mb": sig(
                redis_last["used_memory_mb"] - redis_first["used_memory_mb"]
            ),
            "keys_start": redis_first["keys"],
            "keys_end": redis_last["keys"],
            "max_claim_keys": max(s["redis"]["keys"]["claim"] for s in samples),
        },
        "redis_db": REDIS_DB,
        "redis_key_prefix": prefix,
        "worker_logs": str(log_dir),
        "samples": samples,
    }


# ---------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.soak",
        description="Run the pipeline under a steady request rate and watch memory for growth.",
    )
    p.add_argument("--minutes", type=float, default=5.0, help="how long to send (default 5)")
    p.add_argument("--seconds", type=float, default=None, help="duration in seconds instead")
    p.add_argument("--rps", type=float, default=2.0, help="requests per second (default 2)")
    p.add_argument(
        "--interval-s",
        type=float,
        default=None,
        help="seconds between samples (default 60; duration/6 for runs under 6 minutes)",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="growth is measured after this (default 60; duration/4 for runs under 4 minutes)",
    )
    p.add_argument("--repeat-fraction", type=float, default=0.3, help="share of repeated images")
    p.add_argument(
        "--large-fraction",
        type=float,
        default=0.3,
        help=f"share of new images that are {LARGE_SIDE}px (claim-checked)",
    )
    p.add_argument(
        "--flat-pct",
        type=float,
        default=DEFAULT_FLAT_PCT,
        help=f"RSS growth after warm-up below this percent is 'flat' (default {DEFAULT_FLAT_PCT})",
    )
    p.add_argument("--broker-pid", type=int, default=None, help="broker pid (default: found)")
    p.add_argument("--redis-url", default=None, help="Redis (default EPD_REDIS_URL; DB 11)")
    p.add_argument("--out", type=Path, default=None, help="also write the summary (JSON) here")
    args = p.parse_args(argv)
    duration = args.seconds if args.seconds is not None else args.minutes * 60
    if duration <= 0 or args.rps <= 0:
        p.error("--minutes/--seconds and --rps must be positive")
    if args.interval_s is not None and args.interval_s <= 0:
        p.error("--interval-s must be positive")
    if args.warmup_s is not None and args.warmup_s < 0:
        p.error("--warmup-s must not be negative")
    for name in ("repeat_fraction", "large_fraction"):
        if not 0 <= getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} must be between 0 and 1")
    args.duration_s = duration
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one soak; the summary JSON goes to stdout, per-interval lines to stderr."""
    from runtime.settings import Settings

    production_broker()
    args = parse_args(argv)
    d = args.duration_s
    interval = args.interval_s if args.interval_s is not None else (60.0 if d >= 360 else d / 6)
    warmup = args.warmup_s if args.warmup_s is not None else (60.0 if d >= 240 else d / 4)
    env = Settings()
    db_url = _redis_db_url(args.redis_url or env.redis_url)
    prefix = f"soak-{uuid.uuid4().hex[:12]}"
    settings = env.model_copy(
        update={
            "redis_url": db_url,
            "store_url": f"{db_url}?key_prefix={prefix}:",
            "topic_prefix": prefix,  # local_pipeline appends a run id
            "model": "tiny",
            "device": "cpu",
        }
    )
    opts = Options(
        duration_s=d,
        rps=args.rps,
        interval_s=interval,
        warmup_s=warmup,
        repeat_fraction=args.repeat_fraction,
        large_fraction=args.large_fraction,
        flat_pct=args.flat_pct,
        broker_pid=args.broker_pid,
    )
    log_dir = Path(tempfile.mkdtemp(prefix="soak-"))
    print(
        f"soak: {d:g}s at {args.rps:g} req/s, sample every {interval:g}s, warm-up {warmup:g}s, "
        f"inline limit {env.inline_limit_bytes} B, logs {log_dir}",
        file=sys.stderr,
        flush=True,
    )
    summary = asyncio.run(_soak(settings, opts, log_dir, prefix))
    text = json.dumps(summary, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    for name, g in summary["workers"].items():
        print(
            f"soak: {name}: {g['verdict']} ({g.get('growth_mb')} MB, {g.get('growth_pct')}%)",
            file=sys.stderr,
        )
    return 0 if summary["requests"]["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
