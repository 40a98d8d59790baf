"""Render: a prompt (text or token ids) plus images -> one ``RenderEvent``.

Each image is decoded (with size limits checked before any pixel is decompressed), turned upright
by its EXIF orientation (as vLLM does), converted to RGB by the rule the processor applies
(:func:`to_rgb`), run through the Qwen2-VL image processor, and spliced into the prompt as
``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>`` with N = t*h*w / merge². The
event's ``Features`` carry, per item: a content hash, the placeholder range, the full processor
output (``kwargs_data``) and the light metadata prefill needs (``mm_metadata``:
``image_grid_thw``).

Processing is CPU-bound; async callers use ``render_async``, which runs it in a worker thread.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from runtime.limits import input_limits
from runtime.model import ModelBundle, RenderInfo
from runtime.settings import Settings
from schemas.errors import ValidationError
from schemas.modalities import GRID_FIELDS, MAIN_ENCODER_INPUT
from schemas.signing import ItemHasher
from schemas.types import (
    Features,
    ItemData,
    PlaceholderRange,
    RenderEvent,
    SamplingParams,
)

IMAGE_MARKER = "<image>"
# What the Qwen2-VL chat template emits for one image; accepted as an alias of the marker.
QWEN_IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"

VISION_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_pad|>",
)

ImageInput = Image.Image | bytes | bytearray | memoryview | str | Path

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The only PIL decoders an image may reach. Naming them keeps every other plugin (EPS, which
would run Ghostscript; PSD; TIFF with its many codecs; ...) out of reach of untrusted bytes.
Multi-frame images (GIF, animated WebP/PNG) are read at their first frame."""


SIXTEEN_BIT_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")
"""Modes of 16-bit grayscale PNGs. PIL's own conversion to RGB clips them at 255 (a white
image), so they are scaled to 8 bits first."""


class RenderError(ValidationError):
    """A request the renderer cannot turn into an event; names the rule and the item."""


def to_rgb(img: Image.Image) -> Image.Image:
    """``img`` as 8-bit RGB, the way transformers' ``convert_to_rgb`` (what the HF processor
    runs with ``do_convert_rgb``) does it: any transparency (an alpha band, or a palette or
    grayscale ``transparency`` entry) is composited onto white; other modes (L, 1, P, CMYK, ...)
    convert directly. 16-bit grayscale keeps its top 8 bits first (see ``SIXTEEN_BIT_GRAY``).
    """
    if img.mode in SIXTEEN_BIT_GRAY:
        wide = np.asarray(img).astype(np.int64)
        img = Image.fromarray((np.clip(wide, 0, 65535) >> 8).astype(np.uint8), "L")
    # An RGB PNG may carry a tRNS colour too: transparency is checked before the mode.
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


@dataclass(slots=True)
class _Item:
    modality: str
    mm_hash: str
    offset: int
    length: int
    data: ItemData
    metadata: ItemData | None


@contextmanager
def _pil_errors(index: int) -> Iterator[None]:
    """Turn PIL's decode failures into ``RenderError``s naming the item."""
    try:
        yield
    except Image.DecompressionBombError as e:
        msg = f"decompression bomb refused: {e}"
        raise RenderError("render.image_too_large", msg, modality="image", item=index) from None
    except Image.UnidentifiedImageError:
        raise RenderError(
            "render.image_format",
            f"not an image in an accepted format ({', '.join(IMAGE_FORMATS)})",
            modality="image",
            item=index,
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        # UnidentifiedImageError is an OSError; some plugins raise SyntaxError/EOFError on garbage.
        raise RenderError(
            "render.image_unreadable", f"cannot decode image: {e}", modality="image", item=index
        ) from None


def _placeholder_count(grid: torch.Tensor, merge_size: int) -> int:
    t, h, w = (int(x) for x in grid.reshape(-1).tolist())
    return t * h * w // (merge_size * merge_size)


def build_features(items: Sequence[_Item]) -> Features:
    """Features from rendered items, in one per-modality order shared by all four maps.

    Slots across modalities: if any item of any modality has metadata, ``mm_metadata`` has a
    full-length list for every modality (None where an item has none); if none has, it is null.
    """
    mods: list[str] = []
    for it in items:
        if it.modality not in mods:
            mods.append(it.modality)
    per = {m: [it for it in items if it.modality == m] for m in mods}
    any_meta = any(it.metadata is not None for it in items)
    return Features(
        mm_hashes={m: [it.mm_hash for it in per[m]] for m in mods},
        mm_placeholders={
            m: [PlaceholderRange(it.offset, it.length) for it in per[m]] for m in mods
        },
        kwargs_data={m: [it.data for it in per[m]] for m in mods} if items else None,
        mm_metadata={m: [it.metadata for it in per[m]] for m in mods} if any_meta else None,
    )


class Renderer:
    """Turns prompts and images into ``RenderEvent``s for one model."""

    def __init__(
        self,
        info: RenderInfo | ModelBundle,
        *,
        max_image_pixels: int,
        max_images: int = 64,
        allow_file_paths: bool = False,
    ) -> None:
        """``info``: a ``RenderInfo`` (no weights) or a loaded ``ModelBundle``.

        ``max_image_pixels``: width*height cap checked from the image header before decoding
        (``settings.max_image_pixels``).

        ``allow_file_paths``: read a ``str`` image as a file path. Off by default, because
        strings often come from users (an HTTP body); a ``pathlib.Path`` is always read as a
        file, since the caller built it to name one.
        """
        self.info = info.render_info() if isinstance(info, ModelBundle) else info
        self.max_image_pixels = int(max_image_pixels)
        self.max_images = max_images
        self.allow_file_paths = allow_file_paths
        self.hasher = ItemHasher.for_processor(
            self.info.fingerprint, self.info.image_processor.to_dict()
        )
        tok = self.info.tokenizer
        self._reserved = {
            s: i
            for s in VISION_TOKENS
            if (i := tok.convert_tokens_to_ids(s)) is not None and i != tok.unk_token_id
        }

    @classmethod
    def for_settings(
        cls, info: RenderInfo | ModelBundle, settings: Settings, **kwargs: Any
    ) -> Renderer:
        """A renderer whose pixel limit is ``settings.max_image_pixels`` or, unset, derived from
        the model's processor (:func:`runtime.limits.input_limits`)."""
        ri = info.render_info() if isinstance(info, ModelBundle) else info
        limits = input_limits(settings, ri.image_processor)
        return cls(ri, max_image_pixels=limits.max_image_pixels, **kwargs)

    # ------------------------------------------------------------------ images

    def load_image(self, src: ImageInput, index: int = 0) -> Image.Image:
        """Decode one image to upright RGB, refusing oversize images before their pixels are
        decoded (rule ``render.image_too_large``, from the header's size)."""
        if not isinstance(src, Image.Image | bytes | bytearray | memoryview | str | Path):
            raise RenderError(
                "render.image_type",
                f"unsupported image input type {type(src).__name__}",
                modality="image",
                item=index,
            )
        if isinstance(src, str) and not self.allow_file_paths:
            raise RenderError(
                "render.image_type",
                "a str image is not read as a file path (pass bytes, a PIL image or a "
                "pathlib.Path, or build the renderer with allow_file_paths=True)",
                modality="image",
                item=index,
            )
        if isinstance(src, Image.Image) and src.format not in (None, *IMAGE_FORMATS):
            # A caller-opened image may still be lazy: load() below would run its decoder.
            raise RenderError(
                "render.image_format",
                f"{src.format} images are not accepted ({', '.join(IMAGE_FORMATS)} are)",
                modality="image",
                item=index,
            )
        with _pil_errors(index):
            if isinstance(src, Image.Image):
                img = src
            elif isinstance(src, str | Path):
                img = Image.open(Path(src), formats=IMAGE_FORMATS)
            else:
                # Image.open reads only the header here; pixels are decoded by load() below,
                # after the size check.
                img = Image.open(io.BytesIO(bytes(src)), formats=IMAGE_FORMATS)
        w, h = img.size
        if w <= 0 or h <= 0 or w * h > self.max_image_pixels:
            raise RenderError(
                "render.image_too_large",
                f"image is {w}x{h} = {w * h} pixels; the limit is {self.max_image_pixels}",
                modality="image",
                item=index,
            )
        with _pil_errors(index):
            img.load()
            # A phone stores a portrait photo as landscape pixels plus an Orientation tag;
            # the model must see it upright (vLLM applies the tag too).
            img = ImageOps.exif_transpose(img)
            return to_rgb(img)

    def process_image(self, img: Image.Image, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Processor output for one image: ``pixel_values (patches, dim)``, grid ``(3,)`` int64."""
        try:
            out = self.info.image_processor(images=[img], return_tensors="pt")
        except ValueError as e:  # e.g. aspect ratio above 200
            raise RenderError(
                "render.image_unprocessable", str(e), modality="image", item=index
            ) from None
        pv = out["pixel_values"].contiguous()
        grid = out["image_grid_thw"].reshape(3).to(torch.int64).contiguous()
        return pv, grid

    def mm_hash(self, modality: str, data: ItemData, cache_salt: str | None) -> str:
        """The item's content hash (``ItemHasher``: encoder inputs, processor config, model,
        tenant salt): the same function the fan-out keys the embedding store by."""
        return self.hasher.item_hash(modality, data, cache_salt)

    # ------------------------------------------------------------------ tokens

    def _text_ids(self, text: str) -> list[int]:
        return list(self.info.tokenizer.encode(text, add_special_tokens=False))

    def _prompt_segments(self, prompt: str, n_images: int) -> list[list[int]]:
        """Token ids of the text between image markers (n_images + 1 segments)."""
        text = prompt.replace(QWEN_IMAGE_BLOCK, IMAGE_MARKER)
        for s in self._reserved:
            if s in text:
                raise RenderError(
                    "render.reserved_token",
                    f"prompt contains the reserved token {s!r}; mark images with {IMAGE_MARKER!r}",
                    field="prompt",
                )
        parts = text.split(IMAGE_MARKER)
        if len(parts) - 1 != n_images:
            raise RenderError(
                "render.marker_count",
                f"prompt has {len(parts) - 1} {IMAGE_MARKER!r} markers but {n_images} images "
                "were given",
                field="prompt",
            )
        return [self._text_ids(p) for p in parts]

    def _token_segments(self, token_ids: Sequence[int], n_images: int) -> list[list[int]]:
        """Split token ids at each single ``<|image_pad|>``, dropping a vision_start/end wrap."""
        info = self.info
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if t < 0 or t >= info.vocab_size]
        if bad:
            raise RenderError(
                "render.token_ids",
                f"token ids must be in [0, {info.vocab_size}); got {bad[:5]}",
                field="token_ids",
            )
        if info.video_token_id in ids:
            raise RenderError(
                "render.token_ids", "video items are not supported yet", field="token_ids"
            )
        marks = [i for i, t in enumerate(ids) if t == info.image_token_id]
        if len(marks) != n_images:
            raise RenderError(
                "render.marker_count",
                f"token_ids have {len(marks)} image pad tokens but {n_images} images were given "
                "(mark each image with one <|image_pad|>)",
                field="token_ids",
            )
        segments: list[list[int]] = []
        start = 0
        for m in marks:
            end = m
            if end - 1 >= start and ids[end - 1] == info.vision_start_id:
                end -= 1
            segments.append(ids[start:end])
            start = m + 1
            if start < len(ids) and ids[start] == info.vision_end_id:
                start += 1
        segments.append(ids[start:])
        for seg in segments:
            if info.vision_start_id in seg or info.vision_end_id in seg:
                raise RenderError(
                    "render.token_ids",
                    "vision start/end tokens must wrap an image pad token",
                    field="token_ids",
                )
        return segments

    # ------------------------------------------------------------------ render

    def render(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        images: Sequence[ImageInput] = (),
        cache_salt: str | None = None,
        sampling: SamplingParams | None = None,
        deadline_ms: int | None = None,
        trace: dict[str, str] | None = None,
    ) -> RenderEvent:
        """Render one request. Give exactly one of ``prompt`` (``<image>`` marks each image)
        or ``token_ids`` (one ``<|image_pad|>`` marks each image). Raises ``RenderError``.
        """
        if (prompt is None) == (token_ids is None):
            raise RenderError("render.prompt", "give exactly one of prompt or token_ids")
        images = list(images)
        if len(images) > self.max_images:
            raise RenderError(
                "render.too_many_images",
                f"{len(images)} images; the limit is {self.max_images}",
                modality="image",
            )
        if prompt is not None:
            segments = self._prompt_segments(prompt, len(images))
        else:
            segments = self._token_segments(token_ids or [], len(images))

        info = self.info
        ids: list[int] = list(segments[0])
        items: list[_Item] = []
        for i, src in enumerate(images):
            pv, grid = self.process_image(self.load_image(src, i), i)
            n = _placeholder_count(grid, info.merge_size)
            ids.append(info.vision_start_id)
            offset = len(ids)
            ids.extend([info.image_token_id] * n)
            ids.append(info.vision_end_id)
            ids.extend(segments[i + 1])
            data: ItemData = {MAIN_ENCODER_INPUT["image"]: pv, GRID_FIELDS["image"]: grid}
            items.append(
                _Item(
                    modality="image",
                    mm_hash=self.mm_hash("image", data, cache_salt),
                    offset=offset,
                    length=n,
                    data=data,
                    metadata={GRID_FIELDS["image"]: grid},
                )
            )
        if not ids:
            raise RenderError("render.prompt", "the rendered prompt has no tokens")
        return RenderEvent(
            request_id=request_id,
            model=info.model_name,
            token_ids=ids,
            features=build_features(items),
            sampling=sampling if sampling is not None else SamplingParams(),
            cache_salt=cache_salt,
            deadline_ms=deadline_ms,
            trace=dict(trace or {}),
        )

    async def render_async(self, request_id: str, **kwargs: Any) -> RenderEvent:
        """``render`` in a worker thread, so image decoding never blocks the event loop."""
        return await asyncio.to_thread(self.render, request_id, **kwargs)


def monolithic_inputs(
    event: RenderEvent,
) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """``(token_ids, pixel_values, image_grid_thw)`` for the one-process oracle.

    Image items are concatenated in placeholder (offset) order, which is the order
    ``model.generate`` assigns image features to pad-token runs. Needs inline tensors.
    """
    f = event.features
    ranges = f.mm_placeholders.get("image", [])
    if not ranges:
        return list(event.token_ids), None, None
    if f.kwargs_data is None or "image" not in f.kwargs_data:
        raise RenderError("render.monolithic", "the event carries no image kwargs_data")
    data = f.kwargs_data["image"]
    order = sorted(range(len(ranges)), key=lambda i: ranges[i].offset)
    pvs, grids = [], []
    for i in order:
        item = data[i]
        if item is None:
            raise RenderError("render.monolithic", "item has no data", modality="image", item=i)
        pv, grid = item.get("pixel_values"), item.get("image_grid_thw")
        if not isinstance(pv, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise RenderError(
                "render.monolithic",
                "pixel_values and image_grid_thw must be inline tensors",
                modality="image",
                item=i,
            )
        pvs.append(pv)
        grids.append(grid.reshape(1, 3))
    return list(event.token_ids), torch.cat(pvs), torch.cat(grids)
