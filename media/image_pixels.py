"""An image's ``pixel_values``: the Qwen2-VL image processor's output, bit for bit, in a third
of its time.

The processor resizes with PIL, then rescales (a float64 multiply stored as float32) and
normalises (float32) every 8-bit sample on its own, then lays the patches out. Those middle two
steps depend only on the sample's channel and byte, so they are one lookup in a 3 x 256 table
built once with the processor's own ``rescale`` and ``normalize``; the resize is the processor's
(``smart_resize`` and PIL with its resample filter) and the patch layout its ``patchify`` order.
What costs the processor time is the float64 pass over the whole image and its copies, not the
arithmetic.

:meth:`ImagePixels.for_processor` answers ``None`` (and the caller uses the processor) for a
configuration the table path does not cover, or when a probe of images through both paths
differs (a transformers release that changed a step): it never serves other numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

CHANNELS = 3

_PROBE_SIZES = ((224, 224), (61, 97), (500, 375), (29, 4000))
"""Probe images (width, height): unchanged size, an upscale, a downscale, a long strip."""


@dataclass(frozen=True, slots=True, eq=False)
class ImagePixels:
    """The processor's image path for RGB images: ``(pixel_values, image_grid_thw)``."""

    table: np.ndarray  # (3, 256) float32: each channel's byte -> rescaled, normalised value
    resample: int
    factor: int
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int

    @classmethod
    def for_processor(cls, processor: Any) -> ImagePixels | None:
        """The table path for ``processor``, or ``None`` where it would not match it (or
        where building or probing it fails: the processor then serves, as before)."""
        try:
            pixels = cls._from_config(processor)
            if pixels is None or not pixels._agrees_with(processor):
                return None
        except Exception:  # a processor unlike the one this path was written against
            return None
        return pixels

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        """``pixel_values (patches, 3 * t * p * p)`` float32 and the grid ``(3,)`` int64 of an
        RGB image; ``ValueError`` (the processor's) for an aspect ratio over 200."""
        if image.mode != "RGB":
            raise ValueError(f"ImagePixels takes RGB images, not {image.mode}")
        height, width = smart_resize(
            image.height,
            image.width,
            factor=self.factor,
            min_pixels=self.min_pixels,
            max_pixels=self.max_pixels,
        )
        if image.size != (width, height):
            image = image.resize((width, height), resample=self.resample)
        resized = np.asarray(image)  # PIL's resize to the same size is a copy
        values = np.empty((CHANNELS, height, width), dtype=np.float32)
        for channel in range(CHANNELS):
            np.take(self.table[channel], resized[:, :, channel], out=values[channel])
        patches, grid_h, grid_w = self._patches(values)
        grid = torch.tensor([1, grid_h, grid_w], dtype=torch.int64)
        return torch.from_numpy(patches), grid

    def _patches(self, values: np.ndarray) -> tuple[np.ndarray, int, int]:
        """The processor's patch layout: rows (grid_h/m, grid_w/m, m, m), each row
        (channel, temporal copy, p, p)."""
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        _, height, width = values.shape
        grid_h, grid_w = height // p, width // p
        blocks = values.reshape(CHANNELS, grid_h // m, m, p, grid_w // m, m, p)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
        repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
        rows = np.ascontiguousarray(repeated).reshape(grid_h * grid_w, CHANNELS * t * p * p)
        return rows, grid_h, grid_w

    # ------------------------------------------------------------------ building

    @classmethod
    def _from_config(cls, processor: Any) -> ImagePixels | None:
        size = getattr(processor, "size", None)
        steps = ("do_resize", "do_rescale", "do_normalize")
        if size is None or not all(getattr(processor, s, False) for s in steps):
            return None
        mean, std = processor.image_mean, processor.image_std
        if len(np.atleast_1d(mean)) != CHANNELS or len(np.atleast_1d(std)) != CHANNELS:
            return None
        if not size.shortest_edge or not size.longest_edge:
            return None
        # Every byte of every channel through the processor's own two steps, channel-first.
        every_byte = np.tile(np.arange(256, dtype=np.uint8), (CHANNELS, 1, 1))
        scaled = processor.rescale(every_byte, processor.rescale_factor)
        table = processor.normalize(scaled, mean, std)[:, 0, :]
        if table.dtype != np.float32:
            return None
        return cls(
            table=np.ascontiguousarray(table),
            resample=int(processor.resample),
            factor=processor.patch_size * processor.merge_size,
            min_pixels=int(size.shortest_edge),
            max_pixels=int(size.longest_edge),
            patch_size=int(processor.patch_size),
            merge_size=int(processor.merge_size),
            temporal_patch_size=int(processor.temporal_patch_size),
        )

    def _agrees_with(self, processor: Any) -> bool:
        """Whether the probe images come out of both paths identical, bit for bit."""
        rng = np.random.default_rng(0)
        for width, height in _PROBE_SIZES:
            probe = Image.fromarray(rng.integers(0, 256, (height, width, CHANNELS), np.uint8))
            want = processor(images=[probe], return_tensors="pt")
            pixel_values, grid = self(probe)
            if not torch.equal(want["pixel_values"], pixel_values):
                return False
            if want["image_grid_thw"].reshape(3).tolist() != grid.tolist():
                return False
        return True
