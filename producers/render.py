"""Render: a prompt (text or token ids) plus images and videos -> one ``RenderEvent``.

Each image is decoded (with size limits checked before any pixel is decompressed), turned upright
by its EXIF orientation (as vLLM does), converted to RGB by the rule the processor applies
(:func:`to_rgb`), run through the Qwen2-VL image processor, and spliced into the prompt as
``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>`` with N = t*h*w / merge². The
event's ``Features`` carry, per item: a content hash, the placeholder range, the full processor
output (``kwargs_data``) and the light metadata prefill needs (``mm_metadata``:
``image_grid_thw``).

Videos (:mod:`media.video_items`) are laid out the same way with ``<|video_pad|>``; images
and videos mix in one prompt in any order (``<image>`` / ``<video>`` markers).

The phases, each a module of its own: the prompt split at its marks
(:mod:`producers.prompt_tokens`), each item processed (images here, videos in
:mod:`media.video_items`), its placeholder laid out (:mod:`producers.placeholders`), the
items gathered into ``Features`` (:func:`build_features`); refusals are
:mod:`producers.render_errors`.

Processing is CPU-bound; async callers use ``render_async``, which runs it in a worker thread
and, where the renderer has a :attr:`Renderer.decoder` (the API), decodes encoded images first in
child processes that its timeout kills (:mod:`media.image_decoder`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from media.image_decoder import DecodeTimedOut, ImageDecoder
from media.image_loading import ImageInput, ImageLimits, load_image
from media.image_pixels import ImagePixels
from media.image_structure import StructureLimits
from media.pictures import to_rgb as to_rgb  # re-exported: part of this module's API
from media.video import VideoInput, VideoLimits
from media.video_items import VideoItems
from producers.image_cache import (
    KeyedImage,
    ProcessedImage,
    ProcessedImages,
    image_key,
)
from producers.placeholders import lay_out, lay_out_frames
from producers.prompt_tokens import PromptTokens
from producers.render_errors import RenderError, check_time, image_error, render_timeout
from runtime.model import ModelBundle, RenderInfo, placeholder_ids
from runtime.processor_limits import input_limits
from runtime.settings import Settings
from schemas import defaults
from schemas.modalities import GRID_FIELDS, MAIN_ENCODER_INPUT
from schemas.signing import INLINE_DIGEST_BYTES, ItemHasher
from schemas.types import (
    Features,
    ItemData,
    PlaceholderRange,
    RenderEvent,
    SamplingParams,
)


@dataclass(slots=True)
class _Item:
    modality: str
    mm_hash: str
    offset: int
    length: int
    data: ItemData
    metadata: ItemData | None
    is_embed: list[bool] | None = None


TIMEOUT_GRACE_S = 2.0
"""How long ``render_async`` waits past its timeout for the render to stop itself."""


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
            m: [PlaceholderRange(it.offset, it.length, it.is_embed) for it in per[m]] for m in mods
        },
        kwargs_data={m: [it.data for it in per[m]] for m in mods} if items else None,
        mm_metadata={m: [it.metadata for it in per[m]] for m in mods} if any_meta else None,
    )


INLINE_RENDER_SIZE = 1024
"""A render of images all processed before (kept) and a prompt of up to this many characters
(or token ids) runs on the event loop: its tokenisation, layout and hashes of remembered digests
take less than a worker thread's hand-off."""


class Renderer:
    """Turns prompts and images into ``RenderEvent``s for one model."""

    def __init__(
        self,
        info: RenderInfo | ModelBundle,
        *,
        max_image_pixels: int,
        max_images: int = 64,
        allow_file_paths: bool = False,
        video_limits: VideoLimits | None = None,
        max_tensor_bytes: int = defaults.MAX_TENSOR_BYTES,
        max_video_bytes: int | None = None,
        video_pixels: dict[str, int | None] | None = None,
        structure: StructureLimits | None = None,
        cache_bytes: int = 0,
    ) -> None:
        """``info``: a ``RenderInfo`` (no weights) or a loaded ``ModelBundle``.

        ``max_image_pixels``: width*height cap checked from the image header before decoding
        (``settings.max_image_pixels``). ``structure``: scans and chunks an encoded image may
        have (``EPD_MAX_IMAGE_SCANS``, ``EPD_MAX_IMAGE_CHUNKS``), counted before decoding.
        ``cache_bytes``: bound of the processed-image cache (:mod:`producers.image_cache`,
        ``EPD_RENDER_CACHE_BYTES``) that ``render_async`` reads encoded images from; 0: none.

        ``allow_file_paths``: read a ``str`` image as a file path. Off by default, because
        strings often come from users (an HTTP body); a ``pathlib.Path`` is always read as a
        file, since the caller built it to name one.

        ``video_limits``, ``max_tensor_bytes``, ``max_video_bytes``, ``video_pixels``
        (``min_pixels``, ``max_pixels``, ``max_total_pixels``): see
        :class:`media.video_items.VideoItems` (``VideoLimits.from_settings`` and
        ``VideoItems.settings_kwargs`` give the ``EPD_VIDEO_*`` settings).
        """
        self.info = info.render_info() if isinstance(info, ModelBundle) else info
        self.max_image_pixels = int(max_image_pixels)
        self.image_limits = ImageLimits(self.max_image_pixels, structure or StructureLimits())
        self.decoder: ImageDecoder | None = None
        """Where ``render_async`` decodes encoded images: child processes a timeout kills (the
        API sets one); None: in the render's own thread, for trusted in-process callers."""
        self.max_images = max_images
        self.allow_file_paths = allow_file_paths
        self.videos = VideoItems(
            self.info,
            video_limits,
            max_tensor_bytes=max_tensor_bytes,
            max_file_bytes=max_video_bytes,
            **(video_pixels or {}),
        )
        self.hasher = ItemHasher.for_processor(
            self.info.fingerprint, self.info.image_processor.to_dict()
        )
        self.tokens = PromptTokens(self.info)
        # The processor's numbers by a table (media.image_pixels), or the processor itself.
        self.pixels = ImagePixels.for_processor(self.info.image_processor)
        self.processed = ProcessedImages(cache_bytes)

    @classmethod
    def for_settings(
        cls,
        info: RenderInfo | ModelBundle,
        settings: Settings,
        *,
        max_video_bytes: int | None = None,
        **kwargs: Any,
    ) -> Renderer:
        """A renderer with the deployment's limits: the pixel and tensor caps are the settings'
        or, unset, derived from the model's processor
        (:func:`runtime.processor_limits.input_limits`); the video limits are the
        ``EPD_VIDEO_*`` settings. ``max_video_bytes``: cap on one video file (the API's upload
        limit)."""
        ri = info.render_info() if isinstance(info, ModelBundle) else info
        limits = input_limits(settings, ri.image_processor)
        return cls(
            ri,
            max_image_pixels=limits.max_image_pixels,
            video_limits=VideoLimits.from_settings(settings),
            max_tensor_bytes=limits.max_tensor_bytes,
            max_video_bytes=max_video_bytes,
            video_pixels=VideoItems.settings_kwargs(settings),
            structure=StructureLimits.from_settings(settings),
            cache_bytes=settings.render_cache_bytes,
            **kwargs,
        )

    # ------------------------------------------------------------------ images

    def load_image(self, src: ImageInput, index: int = 0) -> Image.Image:
        """Decode one image to upright RGB, refusing one whose structure or header size is
        over the limits before its pixels are decoded (``image_loading.load_image``)."""
        return load_image(
            src, self.image_limits, image_error(index), allow_file_paths=self.allow_file_paths
        )

    def process_image(self, img: Image.Image, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Processor output for one image: ``pixel_values (patches, dim)``, grid ``(3,)`` int64."""
        try:
            if self.pixels is not None and img.mode == "RGB":
                return self.pixels(img)
            out = self.info.image_processor(images=[img], return_tensors="pt")
        except ValueError as e:  # e.g. aspect ratio above 200
            raise RenderError(
                "render.image_unprocessable", str(e), modality="image", item=index
            ) from None
        pv = out["pixel_values"].contiguous()
        grid = out["image_grid_thw"].reshape(3).to(torch.int64).contiguous()
        return pv, grid

    def _image_outputs(self, src: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An image's processor outputs: kept ones (a :class:`ProcessedImage`), or processed
        now (and kept, for a :class:`KeyedImage`)."""
        if isinstance(src, ProcessedImage):
            return src.pixel_values, src.grid
        keyed = src if isinstance(src, KeyedImage) else None
        pv, grid = self.process_image(
            self.load_image(src if keyed is None else keyed.image, index), index
        )
        if keyed is not None:
            self.processed.put(keyed.key, ProcessedImage(pv, grid))
        return pv, grid

    def mm_hash(self, modality: str, data: ItemData, cache_salt: str | None) -> str:
        """The item's content hash (``ItemHasher``: encoder inputs, processor config, model,
        tenant salt): the same function the fan-out keys the embedding store by."""
        return self.hasher.item_hash(modality, data, cache_salt)

    # ------------------------------------------------------------------ render

    def render(
        self,
        request_id: str,
        *,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        images: Sequence[ImageInput] = (),
        videos: Sequence[VideoInput] = (),
        cache_salt: str | None = None,
        sampling: SamplingParams | None = None,
        deadline_ms: int | None = None,
        trace: dict[str, str] | None = None,
        give_up_at: float | None = None,
    ) -> RenderEvent:
        """Render one request. Give exactly one of ``prompt`` (``<image>`` marks each image,
        ``<video>`` each video) or ``token_ids`` (one ``<|image_pad|>`` / ``<|video_pad|>``
        marks each). Images and videos pair with their markers in order. Raises
        ``RenderError`` (``VideoError`` for a video, a ``ValidationError`` too).
        ``give_up_at``: a ``time.monotonic()`` past which rendering stops (between items and
        between video frames) with ``render.timeout``.
        """
        if (prompt is None) == (token_ids is None):
            raise RenderError("render.prompt", "give exactly one of prompt or token_ids")
        sources: dict[str, list[Any]] = {"image": list(images), "video": list(videos)}
        self._check_counts(sources)
        n_images, n_videos = len(sources["image"]), len(sources["video"])
        if prompt is not None:
            segments, kinds = self.tokens.from_prompt(prompt, n_images, n_videos)
        else:
            segments, kinds = self.tokens.from_token_ids(token_ids or [], n_images, n_videos)
        ids, items = self._splice(segments, kinds, sources, cache_salt, give_up_at)
        if not ids:
            raise RenderError("render.prompt", "the rendered prompt has no tokens")
        return RenderEvent(
            request_id=request_id,
            model=self.info.model_name,
            token_ids=ids,
            features=build_features(items),
            sampling=sampling if sampling is not None else SamplingParams(),
            cache_salt=cache_salt,
            deadline_ms=deadline_ms,
            trace=dict(trace or {}),
        )

    def _check_counts(self, sources: dict[str, list[Any]]) -> None:
        for kind, rule in (
            ("image", "render.too_many_images"),
            ("video", "render.too_many_videos"),
        ):
            if len(sources[kind]) > self.max_images:
                raise RenderError(
                    rule,
                    f"{len(sources[kind])} {kind}s; the limit is {self.max_images}",
                    modality=kind,
                )

    def _splice(
        self,
        segments: list[list[int]],
        kinds: list[str],
        sources: dict[str, list[Any]],
        cache_salt: str | None,
        give_up_at: float | None,
    ) -> tuple[list[int], list[_Item]]:
        """The prompt's token ids with each item's placeholder run spliced in at its marker,
        and the rendered items."""
        seen = {"image": 0, "video": 0}
        ids: list[int] = list(segments[0])
        items: list[_Item] = []
        for k, kind in enumerate(kinds):
            i = seen[kind]
            seen[kind] += 1
            check_time(give_up_at, kind, i)
            items.append(self._item(ids, kind, i, sources[kind][i], cache_salt, give_up_at))
            ids.extend(segments[k + 1])
        return ids, items

    def _item(
        self,
        ids: list[int],
        kind: str,
        index: int,
        src: Any,
        cache_salt: str | None,
        give_up_at: float | None,
    ) -> _Item:
        """Process one image or video and lay its placeholder out onto ``ids``."""
        pad = placeholder_ids(self.info)[kind]
        is_embed: list[bool] | None = None
        if kind == "image":
            pv, grid = self._image_outputs(src, index)
            data: ItemData = {MAIN_ENCODER_INPUT["image"]: pv, GRID_FIELDS["image"]: grid}
            meta: ItemData = {GRID_FIELDS["image"]: grid}
            offset, length = lay_out(ids, self.info, pad, grid)
        else:
            video = self.videos.render(src, index, give_up_at=give_up_at)
            data, meta, grid = video.data, video.metadata, video.grid
            if self.info.family.video_timestamps:
                offset, length, is_embed = lay_out_frames(
                    ids, self.info, pad, grid, video.timestamps, self.tokens.text_ids
                )
            else:
                offset, length = lay_out(ids, self.info, pad, grid)
        return _Item(
            modality=kind,
            mm_hash=self.mm_hash(kind, data, cache_salt),
            offset=offset,
            length=length,
            data=data,
            metadata=meta,
            is_embed=is_embed,
        )

    async def render_async(
        self, request_id: str, *, timeout_s: float | None = None, **kwargs: Any
    ) -> RenderEvent:
        """``render`` off the event loop: encoded images in :attr:`decoder`'s processes when
        it has one, the rest in a worker thread (on the loop when it is light: images processed
        before and a short prompt, :data:`INLINE_RENDER_SIZE`).

        ``timeout_s``: a decode still running at the deadline is killed; the thread's render
        stops itself at the next item or video frame past it (``render.timeout``); should one
        step overrun, the caller is answered ``TIMEOUT_GRACE_S`` later all the same, so a
        render slot is never held for long."""
        give_up_at = None if timeout_s is None else time.monotonic() + timeout_s
        if self.decoder is not None and kwargs.get("images"):
            kwargs["images"] = await self._decoded(list(kwargs["images"]), give_up_at)
        if _light(kwargs):
            return self.render(request_id, give_up_at=give_up_at, **kwargs)
        if give_up_at is None:
            return await asyncio.to_thread(self.render, request_id, **kwargs)
        work = asyncio.to_thread(self.render, request_id, give_up_at=give_up_at, **kwargs)
        try:
            return await asyncio.wait_for(
                work, max(0.0, give_up_at - time.monotonic()) + TIMEOUT_GRACE_S
            )
        except TimeoutError:
            raise render_timeout(None, None) from None

    async def _decoded(self, images: list[ImageInput], give_up_at: float | None) -> list[Any]:
        """The encoded images among ``images`` decoded by :attr:`decoder`, one after another
        (the count is checked first: nothing is decoded for a request refused for it)."""
        assert self.decoder is not None
        self._check_counts({"image": images, "video": []})
        out: list[Any] = []
        for index, src in enumerate(images):
            if not isinstance(src, bytes | bytearray | memoryview):
                out.append(src)  # a PIL image or a path: the thread's render loads it
                continue
            key = await self._key(src)
            kept = None if key is None else self.processed.get(key)
            if kept is not None:
                out.append(kept)  # processed before: nothing to decode
                continue
            try:
                image = await self.decoder.decode(src, image_error(index), give_up_at)
            except DecodeTimedOut:
                raise render_timeout("image", index) from None
            out.append(image if key is None else KeyedImage(image, key))
        return out

    async def _key(self, data: bytes | bytearray | memoryview) -> bytes | None:
        """The processed-image cache's key for ``data`` (None with the cache off)."""
        if not self.processed.enabled:
            return None
        if len(data) <= INLINE_DIGEST_BYTES:
            return image_key(data)
        return await asyncio.to_thread(image_key, data)


def _light(kwargs: dict[str, Any]) -> bool:
    """Whether a render is light enough for the event loop (:data:`INLINE_RENDER_SIZE`): no
    video, every image processed before, a short prompt."""
    if kwargs.get("videos") or not all(
        isinstance(img, ProcessedImage) for img in kwargs.get("images", ())
    ):
        return False
    prompt, token_ids = kwargs.get("prompt"), kwargs.get("token_ids")
    size = len(prompt) if prompt is not None else len(token_ids or ())
    return size <= INLINE_RENDER_SIZE
