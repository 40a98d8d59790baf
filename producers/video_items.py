"""One video input -> one rendered item's fields, for the model's family.

Decoding and sampling (:mod:`producers.video`) and the Qwen2-VL patch rules
(:mod:`producers.video_processing`) are put together here, with the checks that need both: the
processed size is computed from the sampled frame count and the frame size *before* any frame is
resized, and refused when the encoder input would exceed ``max_tensor_bytes``. The item's data is
the processor output (``pixel_values_videos``, ``video_grid_thw`` and, for Qwen2.5-VL,
``second_per_grid_ts`` = temporal patch / sampled fps, as its processor computes it); its
metadata is the family's video metadata fields (the modality table's split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from producers.video import VideoClip, VideoError, VideoInput, VideoLimits, load_video
from producers.video_processing import (
    VideoProcessorConfig,
    config_for_model,
    process_video,
    video_grid,
)
from runtime.model import RenderInfo
from schemas.modalities import MODALITIES
from schemas.types import ItemData

if TYPE_CHECKING:
    pass

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


class VideoItems:
    """Builds video items for one model."""

    def __init__(
        self,
        info: RenderInfo,
        limits: VideoLimits | None = None,
        *,
        max_tensor_bytes: int = 256 * 1024 * 1024,
        max_file_bytes: int | None = None,
    ) -> None:
        """``limits``: sampling and pre-decode limits (default: ``VideoLimits()`` with the
        model's temporal patch). ``max_tensor_bytes``: cap on ``pixel_values_videos`` (float32),
        checked before resizing. ``max_file_bytes``: cap on a video file's size."""
        self.info = info
        self.config: VideoProcessorConfig = config_for_model(info.image_processor, info.model_name)
        tps = self.config.temporal_patch_size
        self.limits = limits or VideoLimits(temporal_patch_size=tps)
        if self.limits.temporal_patch_size != tps:
            self.limits = replace(self.limits, temporal_patch_size=tps)
        self.max_tensor_bytes = int(max_tensor_bytes)
        self.max_file_bytes = max_file_bytes
        self.metadata_fields = info.family.metadata.get("video", ())

    def check_family(self, index: int) -> None:
        """Refuse video for a family this renderer cannot lay out."""
        fam = self.info.family
        if "video" not in fam.modalities or fam.video_frames_per_run is not None:
            # Qwen3-VL writes a timestamp between temporal rows ("<1.0 seconds>"): one item spans
            # several placeholder runs, which this renderer does not produce.
            raise VideoError(
                "render.video_family",
                f"{fam.display_name} video prompts (per-frame timestamps) are not supported; "
                "video works with Qwen2-VL and Qwen2.5-VL",
                modality="video",
                item=index,
            )

    def clip(self, src: VideoInput, index: int = 0) -> VideoClip:
        """Decode and sample one video input."""
        self.check_family(index)
        return load_video(src, self.limits, index, max_bytes=self.max_file_bytes)

    def item(self, clip: VideoClip, index: int = 0) -> VideoItem:
        """Processor output for a sampled clip, size-checked before any frame is resized."""
        w, h = clip.frames[0].size
        try:
            t, gh, gw = video_grid(len(clip.frames), w, h, self.config)
        except ValueError as e:  # aspect ratio above 200
            raise VideoError(
                "render.video_unprocessable", str(e), modality="video", item=index
            ) from None
        nbytes = t * gh * gw * self.config.row_dim * 4
        if nbytes > self.max_tensor_bytes:
            raise VideoError(
                "render.video_too_large",
                f"{len(clip.frames)} sampled frames of {w}x{h} give pixel_values_videos of "
                f"{nbytes} bytes; the limit is {self.max_tensor_bytes} (lower EPD_VIDEO_FPS or "
                "EPD_VIDEO_MAX_FRAMES)",
                modality="video",
                item=index,
            )
        pv, grid = process_video(clip.frames, self.config)
        data: ItemData = {VIDEO.encoder_input: pv, VIDEO.grid or "video_grid_thw": grid}
        if TIMING in self.metadata_fields:
            seconds = self.config.temporal_patch_size / clip.fps
            data[TIMING] = torch.tensor([seconds], dtype=torch.float32)
        meta: ItemData = {k: data[k] for k in self.metadata_fields if k in data}
        return VideoItem(data=data, metadata=meta, grid=grid, frames=len(clip.frames))

    def render(self, src: VideoInput, index: int = 0) -> VideoItem:
        """``clip`` then ``item``."""
        return self.item(self.clip(src, index), index)
