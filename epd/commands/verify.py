"""``epd verify``: the pipeline's tokens must equal one-process ``model.generate`` tokens.

Runs a set of image and video requests through the disaggregated pipeline (encode worker ->
store -> prefill worker) and through ``model.generate(input_ids, pixel_values, image_grid_thw,
pixel_values_videos, video_grid_thw, mm_token_type_ids)`` in this process, greedy, and compares
token ids. Exit 0 only when all match.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.families import MODEL_HELP

if TYPE_CHECKING:
    from epd.local_pipeline import LocalRun
    from runtime.model import ModelBundle


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verify", help="check pipeline tokens against the monolithic model")
    p.add_argument(
        "--model",
        default=None,
        help=f"{MODEL_HELP} (default: EPD_MODEL, tiny)",
    )
    p.add_argument(
        "--external",
        action="store_true",
        help="use the workers already running at EPD_KAFKA_BOOTSTRAP instead of starting some",
    )
    p.add_argument("--images", nargs="*", type=Path, default=[], help="your own image files")
    p.add_argument(
        "--videos", nargs="*", type=Path, default=[], help="your own video files (MP4/WebM/MKV/GIF)"
    )
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument(
        "--decode-stage",
        action="store_true",
        help="run the cases with a separate decode worker (EPD_DECODE_STAGE=true): prefill parks "
        "the KV cache, the decode worker continues from it",
    )
    p.set_defaults(func=run)


@dataclass
class Case:
    """One request of the verification set."""

    name: str
    prompt: str
    images: list[Any]
    videos: list[Any] = field(default_factory=list)


@dataclass
class CaseResult:
    name: str
    status: str
    pipeline: list[int] | None
    monolithic: list[int] | None
    error: str | None = None
    match: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def builtin_cases(video: bool = True) -> list[Case]:
    """Single, two sizes, repeated, non-square, image first and image last; then (``video``)
    the video cases."""
    from media.sample_images import synthetic_image

    a = synthetic_image(112, 112, seed=11)
    return [
        Case("single image", "Describe <image> please.", [a]),
        Case(
            "two images, different sizes",
            "Compare <image> and <image> now.",
            [synthetic_image(168, 84, seed=12), synthetic_image(56, 56, seed=13)],
        ),
        Case("repeated image", "Again <image> please.", [a]),
        Case("non-square image", "What is in <image>?", [synthetic_image(70, 182, seed=14)]),
        Case("image at the start", "<image> is what?", [synthetic_image(98, 98, seed=15)]),
        Case("image at the end", "Look at <image>", [synthetic_image(126, 84, seed=16)]),
        *(video_cases() if video else []),
    ]


def video_cases() -> list[Case]:
    """Video alone (an MP4 file), video + image (a frame list), two videos (MP4 and GIF)."""
    from media.sample_images import synthetic_image
    from media.sample_videos import encode_animation, synthetic_frames, synthetic_mp4

    mp4 = synthetic_mp4(12, 96, 64, fps=6, seed=21)
    return [
        Case("video alone", "What happens in <video>?", [], [mp4]),
        Case(
            "video + image",
            "Is <image> in <video>?",
            [synthetic_image(84, 84, seed=22)],
            [synthetic_frames(6, 112, 56, seed=23)],
        ),
        Case(
            "two videos",
            "Compare <video> with <video>.",
            [],
            [mp4, encode_animation(synthetic_frames(5, 56, 84, seed=24))],
        ),
    ]


def file_cases(paths: list[Path], videos: Sequence[Path] = ()) -> list[Case]:
    """One case per file, plus one prompt with the first two images together."""
    cases = [Case(p.name, "Describe <image>.", [p.read_bytes()]) for p in paths]
    cases += [Case(p.name, "Describe <video>.", [], [p.read_bytes()]) for p in videos]
    if len(paths) >= 2:
        cases.append(
            Case(
                "first two together",
                "Compare <image> with <image>.",
                [c.images[0] for c in cases[:2]],
            )
        )
    return cases


async def verify_cases(
    run: LocalRun,
    bundle: ModelBundle,
    cases: list[Case],
    *,
    max_tokens: int,
    timeout_s: float,
) -> list[CaseResult]:
    """Submit every case (sequentially, so repeats hit the cache) and compare with the oracle."""
    from gpu_workers.oracle import generate_monolithic, monolithic_inputs, monolithic_video_inputs
    from schemas.types import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    events = []
    for case in cases:
        ev, _ = await run.submitter.submit(
            prompt=case.prompt, images=case.images, videos=case.videos, sampling=sampling
        )
        events.append(ev)

    async def oracle(ev: Any) -> list[int]:
        ids, pv, grid = monolithic_inputs(ev)
        videos = monolithic_video_inputs(ev)
        return await asyncio.to_thread(
            lambda: generate_monolithic(
                bundle,
                ids,
                pv,
                grid,
                max_tokens,
                ignore_eos=True,
                pixel_values_videos=videos.get("pixel_values_videos"),
                video_grid_thw=videos.get("video_grid_thw"),
                second_per_grid_ts=videos.get("second_per_grid_ts"),
            )
        )

    results = []
    for case, ev in zip(cases, events, strict=True):
        mono = await oracle(ev)  # one at a time: generate() keeps per-call state on the model
        try:
            rec = await run.submitter.wait(ev.request_id, timeout_s=timeout_s)
        except TimeoutError as exc:
            results.append(CaseResult(case.name, "timeout", None, mono, str(exc)))
            continue
        got = rec.token_ids
        results.append(
            CaseResult(
                case.name,
                rec.status,
                got,
                mono,
                error=json.dumps(rec.error) if rec.error else None,
                match=rec.status == "completed" and got == mono,
            )
        )
    return results


def _check_model(spec: str | None) -> None:
    """Refuse an unsupported model (ModelLoadError: exit 2) before any service or worker starts,
    and the instant engine, which has no model to compare with."""
    from runtime.errors import ModelLoadError
    from runtime.model import model_family
    from runtime.settings import Settings
    from schemas.families import INSTANT_SPEC

    spec = spec or Settings().model
    if spec == INSTANT_SPEC:
        raise ModelLoadError(
            f"{INSTANT_SPEC} runs no model, so there is nothing to verify; give a tiny spec or a "
            "checkpoint"
        )
    model_family(spec)


def run(args: argparse.Namespace) -> int:
    from epd import services

    _check_model(args.model)
    if args.external:
        return asyncio.run(_verify(args, services.state_dir()))
    with services.running(services.state_dir()) as state:
        os.environ.update(state.env)
        return asyncio.run(_verify(args, services.state_dir()))


async def _verify(args: argparse.Namespace, state_dir: Path) -> int:
    from epd.local_pipeline import local_pipeline
    from runtime.model import load_model
    from runtime.settings import Settings

    overrides: dict[str, Any] = {"model": args.model} if args.model else {}
    if args.decode_stage:
        overrides["decode_stage"] = True
    settings = Settings(**overrides)
    own = args.images or args.videos
    from runtime.model import model_family

    video = "video" in model_family(settings.model).modalities
    cases = file_cases(args.images, args.videos) if own else builtin_cases(video)
    bundle_task = asyncio.create_task(
        asyncio.to_thread(load_model, settings.model, device=settings.device)
    )
    async with local_pipeline(
        settings,
        spawn_workers=not args.external,
        log_dir=state_dir / "verify-logs",
        isolate=not args.external,
    ) as run:
        bundle = await bundle_task
        results = await verify_cases(
            run, bundle, cases, max_tokens=args.max_tokens, timeout_s=args.timeout
        )
    ok = all(r.match for r in results)
    if args.json:
        print(json.dumps({"ok": ok, "cases": [r.__dict__ for r in results]}, indent=2))
    else:
        for r in results:
            mark = "MATCH" if r.match else "DIFF "
            print(f"{mark} {r.name:<30} {r.status:<10} pipeline={r.pipeline}")
            if not r.match:
                print(f"      {'':<30} {'':<10} generate={r.monolithic} {r.error or ''}")
        print(f"{sum(r.match for r in results)}/{len(results)} cases match the monolithic model")
    return 0 if ok else 1
