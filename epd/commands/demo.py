"""``epd demo``: the whole pipeline on this machine, with a summary of what travelled where."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from schemas.families import MODEL_HELP
from schemas.status_record import StatusRecord


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run encode/prefill/results workers and a handful of image and video requests",
    )
    p.add_argument("--json", action="store_true", help="print only the summary, as JSON")
    p.add_argument(
        "--model",
        default=None,
        help=f"{MODEL_HELP} (default: EPD_MODEL, tiny)",
    )
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for all requests")
    p.add_argument(
        "--decode-stage",
        action="store_true",
        help="run a separate decode worker (EPD_DECODE_STAGE=true): prefill parks the KV cache "
        "and hands each request over",
    )
    p.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default=None,
        help="what computes (EPD_ENGINE, default transformers); vllm: the workers drive vLLM "
        "instances (EPD_VLLM_PREFILL_URL, EPD_VLLM_ENCODE_URL), or without them the stand-in "
        "built from vLLM 0.33.0's code (not a live vLLM)",
    )
    p.set_defaults(func=run)


@dataclass
class DemoRequest:
    name: str
    prompt: str
    images: list[Any]
    videos: list[Any] = field(default_factory=list)
    result: StatusRecord | None = None
    stats: Any = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def demo_requests(video: bool = True) -> list[DemoRequest]:
    """Several sizes, a non-square image, a repeated image, a two-image prompt and (``video``)
    a small MP4 made in memory with an image beside it."""
    from media.sample_images import synthetic_image
    from media.sample_videos import synthetic_mp4

    cat = synthetic_image(112, 112, seed=1)
    return [
        DemoRequest("small square", "Describe <image> in one line.", [cat]),
        DemoRequest("wide", "What is in <image>?", [synthetic_image(224, 112, seed=2)]),
        DemoRequest("tall", "<image> Caption this.", [synthetic_image(84, 196, seed=3)]),
        DemoRequest("large", "Describe <image>", [synthetic_image(224, 224, seed=4)]),
        DemoRequest("repeat of small square", "Again: <image>", [cat]),
        DemoRequest(
            "two images",
            "Compare <image> with <image>.",
            [synthetic_image(140, 84, seed=5), synthetic_image(56, 56, seed=6)],
        ),
        DemoRequest(
            "image at the end", "Look closely at <image>", [synthetic_image(98, 98, seed=7)]
        ),
        DemoRequest("third time small square", "<image>", [cat]),
        *(
            [
                DemoRequest(
                    "video (MP4, 2 s) + image",
                    "What moves in <video>, and is <image> in it?",
                    [synthetic_image(56, 56, seed=8)],
                    [synthetic_mp4(12, 112, 84, fps=6, seed=9)],
                )
            ]
            if video
            else []
        ),
    ]


def _progress(done: int, total: int, enabled: bool) -> None:
    if not enabled:
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} finished")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\n")


def _check_model(spec: str | None) -> None:
    """Refuse an unsupported model (ModelLoadError: exit 2) before any service or worker starts."""
    from runtime.model import model_family
    from runtime.settings import Settings

    model_family(spec or Settings().model)


def run(args: argparse.Namespace) -> int:
    from epd import services

    _check_model(args.model)
    quiet = args.json
    state_dir = services.state_dir()
    with services.running(state_dir) as state:
        os.environ.update(state.env)  # the settings below and the workers read them
        if getattr(args, "engine", None) != "vllm":
            return asyncio.run(_demo(args, quiet, state_dir))
        return _demo_on_vllm(args, quiet, state_dir)


def _demo_on_vllm(args: argparse.Namespace, quiet: bool, state_dir: Path) -> int:
    """The demo with ``EPD_ENGINE=vllm``: live instances, or the stand-in (said so)."""
    from epd.commands.demo_vllm import VllmUnavailableForDemo, vllm_instances
    from runtime.settings import Settings

    try:
        with vllm_instances(Settings(), state_dir / "demo-logs") as (urls, served_by):
            if not quiet:
                print(f"epd demo --engine vllm: {served_by}", flush=True)
            args.vllm = {"engine": "vllm", **urls, "served_by": served_by}
            return asyncio.run(_demo(args, quiet, state_dir))
    except VllmUnavailableForDemo as exc:
        print(f"epd demo: {exc}", file=sys.stderr)
        return 2


async def _demo(args: argparse.Namespace, quiet: bool, state_dir: Path) -> int:
    """Start the workers, run the demo's requests, print what became of them."""
    from epd.local_pipeline import local_pipeline
    from runtime.kafka import read_topic
    from runtime.model import model_family
    from runtime.settings import Settings
    from schemas.codec import get_codec
    from schemas.topics import Topics
    from schemas.types import EncodedEvent

    def say(msg: str) -> None:
        if not quiet:
            print(msg, flush=True)

    overrides: dict[str, Any] = {"model": args.model} if args.model else {}
    if args.decode_stage:
        overrides["decode_stage"] = True
    vllm = dict(getattr(args, "vllm", None) or {})
    served_by = vllm.pop("served_by", None)
    overrides.update(vllm)
    if getattr(args, "engine", None) == "transformers":
        overrides["engine"] = "transformers"
    settings = Settings(**overrides)
    reqs = demo_requests(video="video" in model_family(settings.model).modalities)
    log_dir = state_dir / "demo-logs"
    t0 = time.perf_counter()
    say(
        f"epd demo: Kafka {settings.kafka_bootstrap}, Redis {settings.redis_url}, "
        f"model {settings.model}"
    )
    stages = (
        "results, encode, prefill and decode"
        if settings.decode_stage
        else "results, encode and prefill"
    )
    say(f"  starting {stages} workers (logs in {log_dir}/)")
    async with local_pipeline(settings, spawn_workers=True, log_dir=log_dir) as run:
        say(
            f"  workers ready after {time.perf_counter() - t0:.1f}s; "
            f"topics {run.settings.topic_prefix}.*"
        )
        await _submit_all(run, reqs, args.max_tokens)
        say(f"  submitted {len(reqs)} requests")
        await _wait_all(run, reqs, args.timeout, tty=not quiet and sys.stderr.isatty())
        codec = get_codec()
        encoded = [
            codec.decode(rec.value, EncodedEvent)
            for rec in await read_topic(run.settings, Topics(run.settings.topic_prefix).encoded)
        ]
    summary = _summary(reqs, encoded, time.perf_counter() - t0)
    if served_by is not None:
        summary["engine"] = f"vllm: {served_by}"
    if quiet:
        print(json.dumps(summary, indent=2))
    else:
        _print_outcomes(reqs, summary)
    return 0 if summary["completed"] == len(reqs) else 1


async def _submit_all(run: Any, reqs: list[DemoRequest], max_tokens: int) -> None:
    """Submit one after another, so the repeated image finds its embedding (or its encode in
    flight); the workers process them concurrently."""
    from schemas.types import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens)
    for r in reqs:
        ev, stats = await run.submitter.submit(
            prompt=r.prompt, images=r.images, videos=r.videos, sampling=sampling
        )
        r.extra["request_id"] = ev.request_id
        r.extra["prompt_tokens"] = len(ev.token_ids)
        r.stats = stats


async def _wait_all(run: Any, reqs: list[DemoRequest], timeout_s: float, *, tty: bool) -> None:
    """Every request's outcome (or its timeout), watching that no worker died meanwhile."""
    done = 0

    async def wait_one(r: DemoRequest) -> None:
        nonlocal done
        try:
            r.result = await run.submitter.wait(r.extra["request_id"], timeout_s=timeout_s)
        except TimeoutError as exc:
            r.error = str(exc)
        done += 1
        _progress(done, len(reqs), tty)

    waits = asyncio.gather(*(wait_one(r) for r in reqs))
    while not waits.done():
        if run.workers is not None:
            run.workers.check_alive()
        await asyncio.wait([waits], timeout=0.5)
    await waits


def _summary(reqs: list[DemoRequest], encoded: list[Any], elapsed: float) -> dict[str, Any]:
    """The demo's figures: outcomes, encoder runs and hits, the bytes on each topic."""
    completed = [r for r in reqs if r.result and r.result.status == "completed"]
    summary: dict[str, Any] = {
        "requests": len(reqs),
        "completed": len(completed),
        "failed": len(reqs) - len(completed),
        "images": sum(len(r.images) for r in reqs),
        "videos": sum(len(r.videos) for r in reqs),
        "encoder_runs": sum(1 for e in encoded if not e.cache_hit),
        "encoder_cache_hits": sum(r.stats.cache_hits for r in reqs)
        + sum(1 for e in encoded if e.cache_hit),
        "bytes_encode_topic": sum(r.stats.encode_bytes for r in reqs),
        "bytes_prefill_topic": sum(r.stats.prefill_bytes for r in reqs),
        "bytes_if_prefill_carried_kwargs_data": sum(
            r.stats.prefill_bytes + r.stats.kwargs_bytes for r in reqs
        ),
        "seconds": round(elapsed, 2),
    }
    summary["prefill_bytes_saved_ratio"] = round(
        summary["bytes_if_prefill_carried_kwargs_data"] / max(summary["bytes_prefill_topic"], 1), 1
    )
    # What went wrong, per request, so `--json` output explains a non-zero exit on its own.
    summary["not_completed"] = [
        {
            "name": r.name,
            "request_id": r.extra.get("request_id"),
            "status": r.result.status if r.result else "timeout",
            "error": (r.result.error if r.result else None) or r.error,
        }
        for r in reqs
        if r not in completed
    ]
    return summary


def _print_outcomes(reqs: list[DemoRequest], summary: dict[str, Any]) -> None:
    print()
    for r in reqs:
        rec = r.result
        status = rec.status if rec else "timeout"
        line = f"  {r.name:<24} {status:<10}"
        if rec is not None and status == "completed":
            line += f" tokens={rec.token_ids}"
            total = rec.timings.get("total")
            if total is not None:
                line += f"  ({total:.0f} ms)"
        else:
            line += f" {(rec.error if rec else None) or r.error}"
        print(line)
    print()
    print("Summary")
    width = max(len(k) for k in summary)
    for k, v in summary.items():
        if k == "not_completed":
            continue  # the per-request lines above already say what happened
        print(f"  {k:<{width}}  {v:,}" if isinstance(v, int) else f"  {k:<{width}}  {v}")
