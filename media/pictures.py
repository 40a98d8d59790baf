"""Pillow rules shared by images and video frames: the decoders untrusted bytes may reach, the
RGB conversion the processor applies, upright orientation, and one mapping of Pillow's decode
failures to rule-named errors.

Images (:mod:`producers.render`) and video frames (:mod:`media.video`: frame lists, animated
GIF/WebP) go through the same functions, so a transparent frame is composited onto white and a
rotated frame is turned upright exactly as an image would be.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image, ImageOps

from schemas.errors import ValidationError

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
"""The only PIL decoders an image may reach. Naming them keeps every other plugin (EPS, which
would run Ghostscript; PSD; TIFF with its many codecs; ...) out of reach of untrusted bytes.
Multi-frame images (GIF, animated WebP/PNG) are read at their first frame."""

SIXTEEN_BIT_GRAY = ("I;16", "I;16L", "I;16B", "I;16N", "I")
"""Modes of 16-bit grayscale PNGs. PIL's own conversion to RGB clips them at 255 (a white
image), so they are scaled to 8 bits first."""

EXIF_ORIENTATION = 0x0112
SWAPPED_ORIENTATIONS = frozenset({5, 6, 7, 8})
"""EXIF orientations that turn the stored pixels by 90 degrees (width and height swap)."""


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


def upright_rgb(img: Image.Image) -> Image.Image:
    """``img`` turned upright by its EXIF orientation (a phone stores a portrait photo as
    landscape pixels plus a tag; vLLM applies the tag too), then :func:`to_rgb`."""
    return to_rgb(ImageOps.exif_transpose(img))


def upright_size(img: Image.Image) -> tuple[int, int]:
    """``(width, height)`` of ``img`` once upright, from its header (no pixels decoded)."""
    w, h = img.size
    try:
        orientation = img.getexif().get(EXIF_ORIENTATION)
    except (OSError, ValueError, SyntaxError, EOFError):
        return w, h  # an unreadable EXIF block: exif_transpose leaves the pixels as they are
    return (h, w) if orientation in SWAPPED_ORIENTATIONS else (w, h)


ErrorFactory = Callable[[str, str], Exception]
"""``(rule, message) -> exception`` naming the caller's modality and item."""


@contextmanager
def pil_errors(
    make: ErrorFactory,
    *,
    too_large: str,
    unreadable: str,
    unidentified: str | None = None,
    what: str = "image",
) -> Iterator[None]:
    """Turn Pillow's decode failures into ``make(rule, message)``: a decompression bomb (a
    header claiming more pixels than ``Image.MAX_IMAGE_PIXELS``; a plain ``Exception`` to
    Pillow) is ``too_large``, bytes no allowed decoder recognises ``unidentified`` (default
    ``unreadable``), any other decode failure ``unreadable``."""
    try:
        yield
    except ValidationError:
        raise  # already names its rule (a ValidationError is a ValueError)
    except Image.DecompressionBombError as e:
        raise make(too_large, f"decompression bomb refused: {e}") from None
    except Image.UnidentifiedImageError:
        raise make(
            unidentified or unreadable,
            f"not an image in an accepted format ({', '.join(IMAGE_FORMATS)})",
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        # UnidentifiedImageError is an OSError; some plugins raise SyntaxError/EOFError on garbage.
        raise make(unreadable, f"cannot decode {what}: {e}") from None
