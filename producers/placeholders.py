"""One item's placeholder run laid out onto the prompt's token ids: the renderer's last step
per item (:mod:`producers.render`).

An image, or a video of a family without timestamps, is ``<|vision_start|>`` + N pads +
``<|vision_end|>`` with N = t*h*w / merge²; a Qwen3-VL video is laid out frame by frame, each
temporal row behind its timestamp text, as the Qwen3-VL processor writes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from producers.render_errors import RenderError
from runtime.model import RenderInfo


def placeholder_count(grid: torch.Tensor, merge_size: int) -> int:
    """Pad tokens of an item with this ``(t, h, w)`` grid: t*h*w / merge²."""
    t, h, w = (int(x) for x in grid.reshape(-1).tolist())
    return t * h * w // (merge_size * merge_size)


def lay_out(ids: list[int], info: RenderInfo, pad: int, grid: torch.Tensor) -> tuple[int, int]:
    """``<|vision_start|>`` + N pads + ``<|vision_end|>`` onto ``ids``; the pads' range."""
    n = placeholder_count(grid, info.merge_size)
    ids.append(info.vision_start_id)
    offset = len(ids)
    ids.extend([pad] * n)
    ids.append(info.vision_end_id)
    return offset, n


def lay_out_frames(
    ids: list[int],
    info: RenderInfo,
    pad: int,
    grid: torch.Tensor,
    timestamps: list[float],
    text_ids: Callable[[str], list[int]],
) -> tuple[int, int, list[bool]]:
    """A video frame by frame (Qwen3-VL): per temporal grid row, its timestamp text
    ``<{t:.1f} seconds>`` (tokenized by ``text_ids``) then ``<|vision_start|>`` + its pads +
    ``<|vision_end|>``, as the Qwen3-VL processor writes it in place of the video's block. The
    item's range is all of it, ``is_embed`` marking the pads (vLLM's layout of the same item)."""
    t, h, w = (int(x) for x in grid.reshape(-1).tolist())
    if len(timestamps) != t:
        raise RenderError(
            "render.video_layout",
            f"{len(timestamps)} frame timestamps for a grid of {t} temporal rows",
            modality="video",
        )
    per_row = h * w // (info.merge_size**2)
    offset = len(ids)
    for seconds in timestamps:
        ids.extend(text_ids(f"<{seconds:.1f} seconds>"))
        ids.append(info.vision_start_id)
        ids.extend([pad] * per_row)
        ids.append(info.vision_end_id)
    return offset, len(ids) - offset, [tok == pad for tok in ids[offset:]]
