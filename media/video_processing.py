"""Qwen2-VL video preprocessing, from the published processor rules, without torchvision.

transformers' ``Qwen2VLVideoProcessor`` imports torchvision, which does not load beside the CPU
torch here, so its rules are implemented again (``video_processing_qwen2_vl.py``, transformers 5):

1. every frame is resized to one ``smart_resize(h, w, factor=patch*merge, min_pixels,
   max_pixels)`` size (bicubic; PIL's filter, as ``Qwen2VLImageProcessorPil`` uses for images);
2. rescaled by 1/255 and normalised with the processor's mean/std (float32);
3. padded to a multiple of ``temporal_patch_size`` frames by repeating the last frame;
4. cut into ``(t, h, w)`` patches ordered (t, h-block, w-block, h-in-block, w-in-block), each row
   ``C x T x P x P``: ``pixel_values_videos (t*h*w, C*T*P*P)`` and ``video_grid_thw (t, h, w)``.

Patch sizes, mean and std come from the model's image processor. The per-frame pixel bounds are
the video processor's, not the image processor's (a 12.8 MP image cap on each of 64 frames would
be a 1.2 GB tensor): a checkpoint's ``video_preprocessor_config.json`` (or the ``video_processor``
entry of its ``processor_config.json``) when it has one, else ``Qwen2VLVideoProcessor``'s defaults
(``VIDEO_MIN_TOKENS`` / ``VIDEO_MAX_TOKENS`` merged tokens per frame, the numbers qwen-vl-utils
calls VIDEO_MIN_PIXELS / VIDEO_MAX_PIXELS), narrowed to the image processor's range. The
published Qwen2-VL / Qwen2.5-VL checkpoints ship no video config (transformers would fall back to
the image processor's ``preprocessor_config.json``, 3,136 to 12,845,056 pixels per frame), so they
get 100,352 to 602,112 pixels per frame. On top, :func:`frame_budget` shares a total pixel budget
across a video's frames, as qwen-vl-utils does with its total-pixels bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize


@dataclass(frozen=True, slots=True)
class VideoProcessorConfig:
    """The numbers of the Qwen2-VL video processor."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale_factor: float = 1 / 255

    @property
    def factor(self) -> int:
        """Frame sides are multiples of this (one merged token)."""
        return self.patch_size * self.merge_size

    @property
    def row_dim(self) -> int:
        """Values in one patch row: C * T * P * P."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (item hashing keys embeddings by the processor config)."""
        return {
            "patch_size": self.patch_size,
            "merge_size": self.merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "min_pixels": self.min_pixels,
            "max_pixels": self.max_pixels,
            "mean": list(self.mean),
            "std": list(self.std),
            "rescale_factor": self.rescale_factor,
        }


def _size(proc: Any) -> tuple[int, int]:
    size = proc.size
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
    lo, hi = get("shortest_edge"), get("longest_edge")
    if lo is None or hi is None:
        raise ValueError(f"processor size needs shortest_edge and longest_edge, got {size}")
    return int(lo), int(hi)


def config_from_image_processor(proc: Any) -> VideoProcessorConfig:
    """The video rules of a model whose image processor is ``proc``."""
    lo, hi = _size(proc)
    return VideoProcessorConfig(
        patch_size=int(proc.patch_size),
        merge_size=int(proc.merge_size),
        temporal_patch_size=int(proc.temporal_patch_size),
        min_pixels=lo,
        max_pixels=hi,
        mean=tuple(float(x) for x in proc.image_mean),  # type: ignore[arg-type]
        std=tuple(float(x) for x in proc.image_std),  # type: ignore[arg-type]
        rescale_factor=float(proc.rescale_factor),
    )


VIDEO_MIN_TOKENS = 128
"""``Qwen2VLVideoProcessor``'s default ``shortest_edge``: 128 x 28 x 28 pixels per frame."""
VIDEO_MAX_TOKENS = 768
"""``Qwen2VLVideoProcessor``'s default ``longest_edge``: 768 x 28 x 28 pixels per frame."""


def default_video_bounds(cfg: VideoProcessorConfig) -> tuple[int, int]:
    """``(min_pixels, max_pixels)`` per frame: the video processor's defaults in this model's
    patch units, narrowed to the image processor's range; a processor whose images are all
    smaller than the default floor (the tiny test models) keeps its own floor."""
    unit = cfg.factor * cfg.factor
    hi = min(cfg.max_pixels, VIDEO_MAX_TOKENS * unit)
    lo = max(cfg.min_pixels, VIDEO_MIN_TOKENS * unit)
    return (lo if lo <= hi else cfg.min_pixels), hi


def _checkpoint_video_config(model_name: str) -> dict[str, Any] | None:
    path = Path(model_name)
    video = path / "video_preprocessor_config.json"
    if video.is_file():
        return dict(json.loads(video.read_text()))
    nested = path / "processor_config.json"  # transformers 5 saves all processors in one file
    if nested.is_file():
        entry = json.loads(nested.read_text()).get("video_processor")
        return dict(entry) if isinstance(entry, dict) else None
    return None


def config_for_model(
    proc: Any, model_name: str, *, min_pixels: int | None = None, max_pixels: int | None = None
) -> VideoProcessorConfig:
    """``config_from_image_processor`` with per-frame video pixel bounds: ``min_pixels`` /
    ``max_pixels`` when given (``EPD_VIDEO_MIN_PIXELS`` / ``EPD_VIDEO_MAX_PIXELS``), else the
    checkpoint's video processor config (``size`` or ``min_pixels``/``max_pixels``), else
    :func:`default_video_bounds`."""
    cfg = config_from_image_processor(proc)
    lo, hi = default_video_bounds(cfg)
    raw = _checkpoint_video_config(model_name)
    if raw is not None:
        size = raw.get("size") or {}
        lo = int(raw.get("min_pixels", size.get("shortest_edge", lo)))
        hi = int(raw.get("max_pixels", size.get("longest_edge", hi)))
    lo, hi = min_pixels or lo, max_pixels or hi
    if lo > hi:
        raise ValueError(f"video min_pixels {lo} is above max_pixels {hi}")
    return replace(cfg, min_pixels=lo, max_pixels=hi)


def frame_budget(cfg: VideoProcessorConfig, frames: int, total_pixels: int) -> VideoProcessorConfig:
    """``cfg`` with each frame's ``max_pixels`` cut to an even share of ``total_pixels`` over the
    ``frames`` frames (padded to the temporal patch), never below ``min_pixels``: qwen-vl-utils'
    rule, so a long densely sampled video gets smaller frames instead of a refusal."""
    padded = -(-frames // cfg.temporal_patch_size) * cfg.temporal_patch_size
    share = max(total_pixels // max(padded, 1), cfg.min_pixels)
    return replace(cfg, max_pixels=min(cfg.max_pixels, share))


def frame_size(width: int, height: int, cfg: VideoProcessorConfig) -> tuple[int, int]:
    """``(height, width)`` every frame is resized to (raises ValueError past 200:1 aspect)."""
    return smart_resize(
        height, width, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
    )


def _normalised(frame: Image.Image, rh: int, rw: int, cfg: VideoProcessorConfig) -> np.ndarray:
    img = frame.convert("RGB") if frame.mode != "RGB" else frame
    if img.size != (rw, rh):
        img = img.resize((rw, rh), resample=Image.Resampling.BICUBIC)
    # Rescale in float64, then float32 for the normalisation: the image processor's arithmetic,
    # so a still frame gives the image processor's values bit for bit.
    x: np.ndarray = (np.asarray(img, dtype=np.float64) * cfg.rescale_factor).astype(np.float32)
    y: np.ndarray = (x - np.asarray(cfg.mean, np.float32)) / np.asarray(cfg.std, np.float32)
    return y.transpose(2, 0, 1)  # (C, H, W)


def process_video(
    frames: list[Image.Image], cfg: VideoProcessorConfig, size: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values_videos (t*h*w, C*T*P*P)`` float32 and ``video_grid_thw (3,)`` int64.
    ``size``: the ``(height, width)`` the frames were already resized to (from
    :func:`frame_size` of the source size); None: computed from the first frame."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    w, h = frames[0].size
    rh, rw = size or frame_size(w, h, cfg)
    x: np.ndarray = np.stack([_normalised(f, rh, rw, cfg) for f in frames])  # (F, C, H, W)
    tps, ps, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -len(frames) % tps:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    gt, gh, gw = x.shape[0] // tps, rh // ps, rw // ps
    c = x.shape[1]
    x = x.reshape(gt, tps, c, gh // m, m, ps, gw // m, m, ps)
    # (t, h-block, w-block, h-in-block, w-in-block, C, T, P, P): the processor's permute.
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = np.ascontiguousarray(x.reshape(gt * gh * gw, c * tps * ps * ps))
    return torch.from_numpy(rows), torch.tensor([gt, gh, gw], dtype=torch.int64)
