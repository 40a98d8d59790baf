"""Qwen2-VL video preprocessing, from the published processor rules, without torchvision.

transformers' ``Qwen2VLVideoProcessor`` imports torchvision, which does not load beside the CPU
torch here, so its rules are implemented again (``video_processing_qwen2_vl.py``, transformers 5):

1. every frame is resized to one ``smart_resize(h, w, factor=patch*merge, min_pixels,
   max_pixels)`` size (bicubic; PIL's filter, as ``Qwen2VLImageProcessorPil`` uses for images);
2. rescaled by 1/255 and normalised with the processor's mean/std (float32);
3. padded to a multiple of ``temporal_patch_size`` frames by repeating the last frame;
4. cut into ``(t, h, w)`` patches ordered (t, h-block, w-block, h-in-block, w-in-block), each row
   ``C x T x P x P``: ``pixel_values_videos (t*h*w, C*T*P*P)`` and ``video_grid_thw (t, h, w)``.

Sizes, mean and std come from the model's image processor (a checkpoint without a
``video_preprocessor_config.json`` gets the same from transformers); a checkpoint's
``video_preprocessor_config.json`` overrides the pixel bounds.
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


def config_for_model(proc: Any, model_name: str) -> VideoProcessorConfig:
    """``config_from_image_processor``, with a checkpoint's ``video_preprocessor_config.json``
    pixel bounds (``size`` or ``min_pixels``/``max_pixels``) when it has one."""
    cfg = config_from_image_processor(proc)
    path = Path(model_name) / "video_preprocessor_config.json"
    if not path.is_file():
        return cfg
    raw = json.loads(path.read_text())
    size = raw.get("size") or {}
    lo = raw.get("min_pixels", size.get("shortest_edge", cfg.min_pixels))
    hi = raw.get("max_pixels", size.get("longest_edge", cfg.max_pixels))
    return replace(cfg, min_pixels=int(lo), max_pixels=int(hi))


def frame_size(width: int, height: int, cfg: VideoProcessorConfig) -> tuple[int, int]:
    """``(height, width)`` every frame is resized to (raises ValueError past 200:1 aspect)."""
    return smart_resize(
        height, width, factor=cfg.factor, min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels
    )


def video_grid(frames: int, width: int, height: int, cfg: VideoProcessorConfig) -> list[int]:
    """``[t, h, w]`` a video of ``frames`` frames of ``width x height`` becomes; cheap (no pixels),
    so the renderer can refuse an oversize video before resizing any frame."""
    rh, rw = frame_size(width, height, cfg)
    t = -(-frames // cfg.temporal_patch_size)
    return [t, rh // cfg.patch_size, rw // cfg.patch_size]


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
    frames: list[Image.Image], cfg: VideoProcessorConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixel_values_videos (t*h*w, C*T*P*P)`` float32 and ``video_grid_thw (3,)`` int64."""
    if not frames:
        raise ValueError("a video needs at least one frame")
    w, h = frames[0].size
    rh, rw = frame_size(w, h, cfg)
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
