"""One video input -> one rendered item's fields, for the model's family.

Decoding and sampling (:mod:`media.video`) and the Qwen2-VL patch rules
(:mod:`media.video_processing`) are put together here, with the checks that need both: the
processed size is computed from the headers (sampled frame count, upright frame size, per-frame
pixel bounds shared out of a total budget) *before* any frame is decoded, refused when the
encoder input would exceed ``max_tensor_bytes``, and each kept frame is resized to it as it is
decoded. The item's data is
the processor output (``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL,
``second_per_grid_ts`` = temporal patch / sampled fps, as its processor computes it); its
metadata is the family's video metadata fields (the modality table's split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from PIL import Image

from media.video import (
    VideoClip,
    VideoError,
    VideoInput,
    VideoLimits,
    VideoPlan,
    load_video,
    plan_video,
)
from media.video_processing import (
    VideoProcessorConfig,
    config_for_model,
    frame_budget,
    frame_size,
    process_video,
)
from runtime.model import RenderInfo
from schemas import defaults
from schemas.modalities import MODALITIES
from schemas.types import ItemData

if TYPE_CHECKING:
    from runtime.settings import Settings

VIDEO = MODALITIES["video"]
TIMING = "second_per_grid_ts"


@dataclass(frozen=True, slots=True)
class VideoItem:
    """A rendered video: its data (full processor output) and its metadata."""

    data: ItemData
    metadata: ItemData
    grid: torch.Tensor
    frames: int
    """Sampled frames (before padding to the temporal patch)."""
    timestamps: list[float]
    """Seconds into the video of each temporal grid row (the mean of its frames' times), as
    Qwen3-VL's prompt writes them before each row."""


class VideoItems:
    """Builds video items for one model."""

    def __init__(
        self,
        info: RenderInfo,
        limits: VideoLimits | None = None,
        *,
        max_tensor_bytes: int = defaults.MAX_TENSOR_BYTES,
        max_file_bytes: int | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
        max_total_pixels: int | None = None,
    ) -> None:
        """``limits``: sampling and pre-decode limits (default: ``VideoLimits()`` with the
        model's temporal patch). ``max_tensor_bytes``: cap on ``pixel_values_videos`` (float32),
        checked before decoding. ``max_file_bytes``: cap on a video file's size.
        ``min_pixels`` / ``max_pixels``: per-frame bounds (default: the checkpoint's video
        processor config, else the video processor's defaults). ``max_total_pixels``: pixels of
        all of a video's frames together (default: as many as ``max_tensor_bytes`` holds)."""
        self.info = info
        self.config: VideoProcessorConfig = config_for_model(
            info.image_processor, info.model_name, min_pixels=min_pixels, max_pixels=max_pixels
        )
        tps = self.config.temporal_patch_size
        self.limits = limits or VideoLimits(temporal_patch_size=tps)
        if self.limits.temporal_patch_size != tps:
            self.limits = replace(self.limits, temporal_patch_size=tps)
        self.max_tensor_bytes = int(max_tensor_bytes)
        # fp32 values per pixel of a padded frame: C channels x 4 bytes.
        self.max_total_pixels = max_total_pixels or self.max_tensor_bytes // (3 * 4)
        self.max_file_bytes = max_file_bytes
        self.metadata_fields = info.family.metadata.get("video", ())

    @classmethod
    def settings_kwargs(cls, settings: Settings) -> dict[str, int | None]:
        """The ``EPD_VIDEO_*`` pixel settings as constructor keywords."""
        return {
            "min_pixels": settings.video_min_pixels,
            "max_pixels": settings.video_max_pixels,
            "max_total_pixels": settings.video_max_total_pixels,
        }

    def check_family(self, index: int) -> None:
        """Refuse video for a family that does not run it."""
        fam = self.info.family
        if "video" not in fam.modalities:
            raise VideoError(
                "render.video_family",
                f"{fam.display_name} does not take video",
                modality="video",
                item=index,
            )

    def clip(self, src: VideoInput, index: int = 0) -> VideoClip:
        """Decode and sample one video input (frames at their own size)."""
        self.check_family(index)
        return load_video(src, self.limits, index, max_bytes=self.max_file_bytes)

    def plan(self, src: VideoInput, index: int = 0) -> VideoPlan:
        """Headers read and every pre-decode limit checked (:func:`media.video.plan_video`)."""
        self.check_family(index)
        return plan_video(src, self.limits, index, max_bytes=self.max_file_bytes)

    def sized(
        self, frames: int, width: int, height: int, index: int = 0
    ) -> tuple[VideoProcessorConfig, tuple[int, int]]:
        """The processor config for ``frames`` frames of ``width x height`` (per-frame cap shared
        out of ``max_total_pixels``) and the ``(height, width)`` every frame is resized to;
        refuses a video whose ``pixel_values_videos`` would exceed ``max_tensor_bytes``."""
        cfg = frame_budget(self.config, frames, self.max_total_pixels)
        try:
            rh, rw = frame_size(width, height, cfg)
        except ValueError as e:  # aspect ratio above 200
            raise VideoError(
                "render.video_unprocessable", str(e), modality="video", item=index
            ) from None
        t = -(-frames // cfg.temporal_patch_size)
        nbytes = t * (rh // cfg.patch_size) * (rw // cfg.patch_size) * cfg.row_dim * 4
        if nbytes > self.max_tensor_bytes:
            raise VideoError(
                "render.video_too_large",
                f"{frames} sampled frames of {width}x{height}, each resized to {rw}x{rh} (at "
                f"least min_pixels={cfg.min_pixels} per frame), give pixel_values_videos of "
                f"{nbytes} bytes; the limit is {self.max_tensor_bytes} (EPD_MAX_TENSOR_BYTES): "
                "lower EPD_VIDEO_FPS, EPD_VIDEO_MAX_FRAMES or EPD_VIDEO_MIN_PIXELS",
                modality="video",
                item=index,
            )
        return cfg, (rh, rw)

    def _item(
        self,
        frames: list[Image.Image],
        fps: float,
        cfg: VideoProcessorConfig,
        size: tuple[int, int],
        times: list[float],
    ) -> VideoItem:
        pv, grid = process_video(frames, cfg, size)
        data: ItemData = {VIDEO.encoder_input: pv, VIDEO.grid or "video_grid_thw": grid}
        if TIMING in self.metadata_fields:
            seconds = self.config.temporal_patch_size / fps
            data[TIMING] = torch.tensor([seconds], dtype=torch.float32)
        meta: ItemData = {k: data[k] for k in self.metadata_fields if k in data}
        rows = row_timestamps(times, cfg.temporal_patch_size)
        return VideoItem(data=data, metadata=meta, grid=grid, frames=len(frames), timestamps=rows)

    def item(self, clip: VideoClip, index: int = 0) -> VideoItem:
        """Processor output for an already decoded clip (its frames taken ``1 / fps`` apart)."""
        w, h = clip.frames[0].size
        cfg, size = self.sized(len(clip.frames), w, h, index)
        times = [i / clip.fps for i in range(len(clip.frames))]
        return self._item(clip.frames, clip.fps, cfg, size, times)

    def render(
        self, src: VideoInput, index: int = 0, *, give_up_at: float | None = None
    ) -> VideoItem:
        """Plan, size-check, then decode only the kept frames, each resized as it is decoded.
        ``give_up_at``: a ``time.monotonic()`` past which decoding stops (``render.timeout``)."""
        plan = self.plan(src, index)
        try:
            cfg, (rh, rw) = self.sized(len(plan.keep), plan.width, plan.height, index)
        except BaseException:
            plan.close()
            raise
        clip = plan.clip((rw, rh), give_up_at)
        times = [i / plan.native_fps for i in plan.keep]
        return self._item(clip.frames, clip.fps, cfg, (rh, rw), times)


def row_timestamps(frame_times: list[float], temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal grid row: the frames padded to whole temporal patches by
    repeating the last (as the processor pads them), each row the mean of its first and last
    frame's time (Qwen3-VL's processor and vLLM compute them so)."""
    if not frame_times:
        return []
    tps = temporal_patch_size
    padded = frame_times + [frame_times[-1]] * (-len(frame_times) % tps)
    return [(padded[i] + padded[i + tps - 1]) / 2 for i in range(0, len(padded), tps)]
