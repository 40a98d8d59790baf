"""Input limits and the pixel transport dtype, derived from the model's image processor.

A Qwen2-VL processor resizes every image to at most ``max_pixels`` (``size["longest_edge"]``)
before patching, so the largest ``pixel_values`` it can emit is known in advance: ``max_pixels``
pixels x 3 channels x ``temporal_patch_size`` (an image is repeated to fill the temporal patch),
in fp32. Deriving the limits from it means any image the processor accepts can travel, and a
processor with a smaller ``max_pixels`` gets tighter limits for free. Explicit settings
(``EPD_MAX_TENSOR_BYTES``, ``EPD_MAX_IMAGE_PIXELS``) still win.

Importing this module imports no torch (the render router reads its limits and pixel dtype);
only :func:`pixel_dtype`'s torch form and a CUDA probe for ``EPD_DEVICE=auto`` load it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runtime.errors import ModelLoadError
from runtime.settings import Settings
from schemas import defaults

if TYPE_CHECKING:
    import torch

PIXEL_CHANNELS = 3
PROCESSOR_ITEMSIZE = 4
"""The processor emits fp32; bf16 transport only ever shrinks a tensor."""
MIN_DECODE_PIXELS = 4096 * 4096
"""Decoding floor: a model whose processor keeps images tiny still reads ordinary photos (the
processor scales them down)."""
DECODE_FACTOR = 4
"""Images up to ``DECODE_FACTOR x max_pixels`` are decoded (the processor halves each side at
most); a 48 MP phone photo fits the public Qwen2-VL config."""

DEFAULT_TENSOR_BYTES = defaults.MAX_TENSOR_BYTES
"""Floor of the derived tensor limit: a small processor keeps the headroom it had."""

PIXEL_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp32": "float32"}
"""``EPD_PIXEL_DTYPE`` -> the wire name of the dtype encoder inputs travel in."""


@dataclass(frozen=True, slots=True)
class InputLimits:
    """What one deployment accepts, with where each number came from."""

    max_pixels: int
    """The processor's own resize cap (``size["longest_edge"]``)."""
    max_image_pixels: int
    """width x height refused from the image header, before any pixel is decoded."""
    max_tensor_bytes: int
    """Largest tensor (inline or claim check) the validators accept."""


def processor_max_pixels(processor: Any) -> int:
    """The processor's resize cap: ``size["longest_edge"]`` (transformers 5), else its
    ``max_pixels`` attribute (older configs)."""
    size = getattr(processor, "size", None)
    value = None
    if isinstance(size, dict):
        value = size.get("longest_edge") or size.get("max_pixels")
    elif size is not None:
        value = getattr(size, "longest_edge", None)
    value = value or getattr(processor, "max_pixels", None)
    if not value:
        raise ValueError(f"{type(processor).__name__} has no max_pixels / size.longest_edge")
    return int(value)


def pixel_tensor_bytes(max_pixels: int, temporal_patch_size: int) -> int:
    """Bytes of the largest fp32 ``pixel_values`` for images of at most ``max_pixels``."""
    return max_pixels * PIXEL_CHANNELS * temporal_patch_size * PROCESSOR_ITEMSIZE


def processor_temporal_patch(processor: Any) -> int:
    """How many frames one patch spans (an image is repeated to fill them); 2 by default."""
    return int(getattr(processor, "temporal_patch_size", 2) or 2)


def input_limits(settings: Settings, processor: Any) -> InputLimits:
    """The limits for ``processor``: derived unless the settings name them explicitly."""
    return limits_for(
        settings, processor_max_pixels(processor), processor_temporal_patch(processor)
    )


def limits_for(settings: Settings, max_pixels: int, temporal: int) -> InputLimits:
    """The limits for a processor's resize cap and temporal patch size (what
    :func:`input_limits` reads of it): derived unless the settings name them explicitly."""
    derived_tensor = pixel_tensor_bytes(max_pixels, temporal)
    derived_pixels = max(MIN_DECODE_PIXELS, DECODE_FACTOR * max_pixels)
    return InputLimits(
        max_pixels=max_pixels,
        max_image_pixels=settings.max_image_pixels or derived_pixels,
        # The default 256 MiB stays the floor: smaller processors keep today's headroom.
        max_tensor_bytes=settings.max_tensor_bytes or max(DEFAULT_TENSOR_BYTES, derived_tensor),
    )


def deployment_tensor_limit(settings: Settings) -> int:
    """The tensor limit the deployment's fan-out and workers use, for tools that check events
    outside them (``epd dlq replay``, ``epd validate``): derived from ``EPD_MODEL``'s processor,
    or the explicit setting, or, when the model cannot be loaded here, the default floor."""
    if settings.max_tensor_bytes:
        return settings.max_tensor_bytes
    from runtime.model import load_render_info

    try:
        info = load_render_info(settings.model)
    except (ModelLoadError, OSError, ValueError):
        return DEFAULT_TENSOR_BYTES
    return input_limits(settings, info.image_processor).max_tensor_bytes


def pixel_dtype(settings: Settings) -> torch.dtype:
    """The torch dtype encoder inputs travel in: :func:`pixel_dtype_name`'s."""
    from schemas.tensors import torch_dtype

    return torch_dtype(pixel_dtype_name(settings))


def resolve_device(spec: str) -> torch.device:
    """``runtime.model.resolve_device`` (imported when called: it needs torch)."""
    from runtime.model import resolve_device as resolve

    return resolve(spec)


def pixel_dtype_name(settings: Settings) -> str:
    """The wire name of the dtype encoder inputs travel in (``EPD_PIXEL_DTYPE``).

    ``auto``: bf16 when ``EPD_DEVICE`` names CUDA (``cuda``, ``cuda:N``: the deployment's
    workers run the vision tower in bf16 anyway, so casting before transport gives them the very
    same values, even when the process fanning out has no GPU itself), or is ``auto`` and this
    process has CUDA; fp32 otherwise (a CPU worker computes in fp32: CPU parity with
    ``model.generate`` stays exact). A fan-out without GPU for CUDA workers left on ``auto``
    sends fp32: set ``EPD_PIXEL_DTYPE=bf16`` there (the compose file does). Only ``auto`` on
    both asks torch (is there CUDA here?): a render router, which otherwise imports no torch,
    should be told either.
    """
    if settings.pixel_dtype != "auto":
        return PIXEL_DTYPES[settings.pixel_dtype]
    spec = settings.device.strip().lower()
    if spec.startswith("cuda"):
        return PIXEL_DTYPES["bf16"]
    if spec == "cpu":  # settled without asking torch (the render router imports none)
        return PIXEL_DTYPES["fp32"]
    try:
        cuda = resolve_device(settings.device).type == "cuda"
    except ModelLoadError:  # a device this process cannot resolve: keep the exact choice
        cuda = False
    return PIXEL_DTYPES["bf16" if cuda else "fp32"]
