"""One encoded image -> upright RGB, with every limit checked before its pixels are decoded.

Order: the input's type; its container structure (:mod:`media.image_structure`: scans,
chunks); the header's pixel count; only then the decode. The same function runs in the
renderer's thread (trusted, in-process callers) and in the API's decode processes
(:mod:`media.image_decoder`), which is why it needs nothing heavier than Pillow: no torch.
"""

from __future__ import annotations

import io
import re
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from media.image_structure import StructureLimits, too_complex
from media.pictures import IMAGE_FORMATS, ErrorFactory, pil_errors, upright_rgb

ImageInput = Image.Image | bytes | bytearray | memoryview | str | Path


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What decoding one image may cost."""

    max_pixels: int
    """width x height, from the header (``EPD_MAX_IMAGE_PIXELS`` or derived)."""
    structure: StructureLimits = field(default_factory=StructureLimits)


def load_image(
    src: ImageInput, limits: ImageLimits, make: ErrorFactory, *, allow_file_paths: bool = False
) -> Image.Image:
    """Decode one image to upright RGB; every refusal is ``make(rule, message)``.

    A ``str`` is a file path only with ``allow_file_paths`` (strings often come from users); a
    ``pathlib.Path`` always is. A PIL image a caller opened is taken as it is (its structure is
    the caller's business), but its size is still checked before it is loaded."""
    img = _open(src, limits, make, allow_file_paths)
    w, h = img.size
    if w <= 0 or h <= 0 or w * h > limits.max_pixels:
        raise too_large(make, w * h, limits.max_pixels, f"{w}x{h} = ")
    with _pil_errors(make):
        img.load()
        return upright_rgb(img)


def _open(
    src: ImageInput, limits: ImageLimits, make: ErrorFactory, allow_file_paths: bool
) -> Image.Image:
    """The image with its header read and its pixels not yet decoded."""
    if not isinstance(src, Image.Image | bytes | bytearray | memoryview | str | Path):
        raise make("render.image_type", f"unsupported image input type {type(src).__name__}")
    if isinstance(src, str) and not allow_file_paths:
        raise make(
            "render.image_type",
            "a str image is not read as a file path (pass bytes, a PIL image or a "
            "pathlib.Path, or build the renderer with allow_file_paths=True)",
        )
    if isinstance(src, Image.Image):
        if src.format not in (None, *IMAGE_FORMATS):
            # A caller-opened image may still be lazy: load() would run its decoder.
            raise make(
                "render.image_format",
                f"{src.format} images are not accepted ({', '.join(IMAGE_FORMATS)} are)",
            )
        return src
    data = _read(src, make) if isinstance(src, str | Path) else bytes(src)
    return open_bytes(data, limits, make)


def open_bytes(data: bytes, limits: ImageLimits, make: ErrorFactory) -> Image.Image:
    """``data`` opened with the accepted decoders after its structure was counted (header
    read, pixels not decoded)."""
    why = too_complex(data, limits.structure)
    if why is not None:
        raise make("render.image_too_complex", why)
    with _pil_errors(make):
        try:
            return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except Image.DecompressionBombError as e:
            # Pillow's own guard answers first for a huge header; say ours.
            raise too_large(make, _bomb_pixels(e), limits.max_pixels) from None


def _read(path: str | Path, make: ErrorFactory) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise make("render.image_unreadable", f"cannot read the image file: {e}") from None


def _pil_errors(make: ErrorFactory) -> AbstractContextManager[None]:
    return pil_errors(
        make,
        too_large="render.image_too_large",
        unreadable="render.image_unreadable",
        unidentified="render.image_format",
    )


def _bomb_pixels(exc: Exception) -> int | None:
    """The pixel count in Pillow's decompression-bomb message ("Image size (N pixels) ...")."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    return int(found.group(1)) if found else None


def too_large(make: ErrorFactory, pixels: int | None, limit: int, size: str = "") -> Exception:
    """Rule ``render.image_too_large``, naming the limit (and Pillow's guard where it spoke)."""
    guard = f"Pillow's decompression bomb guard ({2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels)"
    if pixels is None:
        what = f"image is larger than {guard}"
    elif pixels <= limit:  # above Pillow's guard though within ours
        what = f"image is {size}{pixels} pixels, above {guard}"
    else:
        what = f"image is {size}{pixels} pixels"
    return make(
        "render.image_too_large", f"{what}; the limit is {limit} pixels (EPD_MAX_IMAGE_PIXELS)"
    )
