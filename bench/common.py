"""Shared benchmark helpers: timing statistics, machine facts, the 1024x1024 Qwen2-VL fixture.

Every benchmark returns a JSON-able dict with its measured numbers, a ``budget`` block quoting
docs/design.md ("Budgets") and ``meets_budget``. Timings use ``time.perf_counter`` and
report the median (p50) and p90 of N repeats after a warm-up, so one slow outlier on a shared
machine does not decide the result.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

# Qwen2-VL-2B/7B-Instruct's preprocessor_config.json: patch 14, merge 2, temporal 2,
# min_pixels 56*56, max_pixels 28*28*16384, so a 1024x1024 image passes unscaled (but for
# rounding to a multiple of 28: 1036x1036 -> grid (1, 74, 74), 5476 patches of 1176 values).
QWEN2VL_PROCESSOR: dict[str, int] = {
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
}
IMAGE_SIDE = 1024
MODEL_NAME = "Qwen2-VL (processor config only)"
MODEL_FINGERPRINT = "bench-qwen2vl-processor"


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of repeated timings, in seconds."""

    samples: list[float]

    @property
    def p50(self) -> float:
        return statistics.median(self.samples)

    @property
    def p90(self) -> float:
        return quantile(self.samples, 0.9)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    def to_json(self, unit: str = "ms") -> dict[str, float | int]:
        """p50/p90/mean/min in ``unit`` (``ms`` or ``us``) and the sample count."""
        scale = {"ms": 1e3, "us": 1e6, "s": 1.0}[unit]
        return {
            f"p50_{unit}": sig(self.p50 * scale),
            f"p90_{unit}": sig(self.p90 * scale),
            f"mean_{unit}": sig(self.mean * scale),
            f"min_{unit}": sig(self.min * scale),
            "n": len(self.samples),
        }


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (never to 0 for a tiny positive value)."""
    return float(f"{x:.{digits}g}")


def quantile(samples: list[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("no samples")
    s = sorted(samples)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def measure(fn: Callable[[], Any], repeat: int, warmup: int = 1) -> Stats:
    """Time ``fn()`` ``repeat`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return Stats(out)


async def measure_async(fn: Callable[[], Awaitable[Any]], repeat: int, warmup: int = 1) -> Stats:
    """Time ``await fn()`` ``repeat`` times after ``warmup`` untimed calls."""
    for _ in range(warmup):
        await fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return Stats(out)


def ratio(slow: float, fast: float) -> float:
    """``slow / fast`` rounded for reports (inf when ``fast`` is 0)."""
    return sig(slow / fast) if fast > 0 else float("inf")


def headroom(value: float, threshold: float, *, higher_is_better: bool) -> float:
    """How many times inside its budget a number is: > 1 met with room, < 1 missed."""
    if higher_is_better:
        return sig(value / threshold)
    return sig(threshold / value) if value > 0 else float("inf")


def budget(text: str, **numbers: float) -> dict[str, Any]:
    """A budget block: docs/design.md's wording plus the numeric thresholds it implies."""
    return {"design": text, **numbers}


BROKER_JVM_PROFILE = "production"
"""The embedded Apache Kafka's JVM in benchmark runs (``EPD_KAFKA_JVM_PROFILE``): C2 and G1 as
in production (docker-compose.yml), not the fast-start profile of ``epd up`` and the tests."""


def production_broker() -> str:
    """Ask for :data:`BROKER_JVM_PROFILE` in the brokers this process and its children start
    (``epd.services``), unless ``EPD_KAFKA_JVM_PROFILE`` is set (``fast``, to compare); the
    profile in force. Every benchmark entry point calls it first."""
    return os.environ.setdefault("EPD_KAFKA_JVM_PROFILE", BROKER_JVM_PROFILE)


def machine_facts() -> dict[str, Any]:
    """CPU count, Python, library versions and the BLAS override, for reading results later."""
    import fastavro
    import msgpack
    import numpy
    import torch
    import transformers

    return {
        "cpu_count": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "fastavro": fastavro.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
        "numpy": numpy.__version__,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
    }


# ---------------------------------------------------------------------------------------------
# The 1024x1024 image through Qwen2-VL's processor, rendered once per process.


@cache
def render_info() -> Any:
    """A ``RenderInfo`` with Qwen2-VL's real processor config and the tiny byte tokenizer.

    No weights are needed: the renderer only uses the processor, the tokenizer and the ids.
    """
    from transformers import Qwen2VLImageProcessorPil

    from runtime.model import RenderInfo
    from runtime.tokenizer import EOS_TOKEN, TINY_VOCAB_SIZE, build_tiny_tokenizer
    from schemas.families import FAMILIES

    tok = build_tiny_tokenizer()

    def tid(token: str) -> int:
        found = tok.convert_tokens_to_ids(token)
        if not isinstance(found, int):
            raise TypeError(f"token {token!r} did not map to one id: {found!r}")
        return found

    return RenderInfo(
        model_name=MODEL_NAME,
        family=FAMILIES["qwen2_vl"],
        fingerprint=MODEL_FINGERPRINT,
        image_processor=Qwen2VLImageProcessorPil(
            patch_size=QWEN2VL_PROCESSOR["patch_size"],
            merge_size=QWEN2VL_PROCESSOR["merge_size"],
            temporal_patch_size=QWEN2VL_PROCESSOR["temporal_patch_size"],
            min_pixels=QWEN2VL_PROCESSOR["min_pixels"],
            max_pixels=QWEN2VL_PROCESSOR["max_pixels"],
        ),
        tokenizer=tok,
        image_token_id=tid("<|image_pad|>"),
        video_token_id=tid("<|video_pad|>"),
        vision_start_id=tid("<|vision_start|>"),
        vision_end_id=tid("<|vision_end|>"),
        eos_token_id=tid(EOS_TOKEN),
        merge_size=QWEN2VL_PROCESSOR["merge_size"],
        vocab_size=TINY_VOCAB_SIZE,
        context_length=32768,  # Qwen2-VL's max_position_embeddings (the tiny models' too)
    )


@cache
def rendered_1024() -> Any:
    """The ``RenderEvent`` of one 1024x1024 synthetic image with a short prompt (cached)."""
    from media.sample_images import synthetic_image
    from producers.render import Renderer

    renderer = Renderer(render_info(), max_image_pixels=4096 * 4096)
    return renderer.render(
        "bench-1024",
        prompt="Describe this picture: <image> in one sentence.",
        images=[synthetic_image(IMAGE_SIDE, IMAGE_SIDE, seed=7)],
    )
