"""Deterministic synthetic images for the demo, `epd verify`, tests and benchmarks."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """An RGB image with gradients, stripes and noise: cheap to make, distinct per seed."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 255 * x / max(width - 1, 1)
    g = 255 * y / max(height - 1, 1)
    b = 127 + 127 * np.sin((x + y) / (3 + seed % 7))
    img = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def png_bytes(img: Image.Image) -> bytes:
    """The image encoded as PNG."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def repeated_scan_jpeg(side: int, scans: int) -> bytes:
    """A progressive JPEG of ``side x side`` whose last scan is repeated ``scans`` times: small
    on the wire (a few bytes a scan) and slow to decode (each scan is a pass over every block).
    The decode bomb that :mod:`media.image_structure` refuses; for tests and benchmarks."""
    out = io.BytesIO()
    Image.new("RGB", (side, side), (120, 30, 200)).save(out, "JPEG", progressive=True, quality=50)
    data = out.getvalue()
    last_scan, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:end] + data[last_scan:end] * scans + data[end:]
