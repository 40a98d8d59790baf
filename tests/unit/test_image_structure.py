"""Container structure counted before decoding (media.image_structure): what each format's
walker finds in files Pillow writes, and the decode bombs it refuses."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from media.image_loading import ImageLimits, load_image
from media.image_structure import StructureLimits, measure, too_complex
from media.sample_images import repeated_scan_jpeg
from schemas.errors import ValidationError

LIMITS = StructureLimits(max_scans=100, max_chunks=64)


def encoded(fmt: str, mode: str = "RGB", **save: object) -> bytes:
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (64, 80, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    img.save(out, fmt, **save)
    return out.getvalue()


@pytest.mark.parametrize(
    ("data", "scans"),
    [
        (encoded("JPEG"), 1),
        (encoded("JPEG", progressive=True), 10),
        (encoded("JPEG", "L", progressive=True), 6),
    ],
    ids=["baseline", "progressive", "progressive-gray"],
)
def test_jpeg_scans_are_counted_as_the_decoder_will_run_them(data: bytes, scans: int) -> None:
    found = measure(data, LIMITS)
    assert found is not None and found.scans == scans
    assert too_complex(data, LIMITS) is None


def test_a_jpeg_of_repeated_scans_is_refused_naming_the_limit_and_its_setting() -> None:
    bomb = repeated_scan_jpeg(256, 500)
    assert len(bomb) < 20_000  # small on the wire
    limits = StructureLimits(max_scans=100)
    why = too_complex(bomb, limits)
    assert why is not None and "100 scans" in why and "EPD_MAX_IMAGE_SCANS" in why
    with pytest.raises(ValidationError) as e:
        load_image(bomb, ImageLimits(4096 * 4096, limits), ValidationError)
    assert e.value.rule == "render.image_too_complex"


def test_garbage_between_segments_cannot_hide_a_scan() -> None:
    """libjpeg skips bytes it does not understand up to the next marker; so does the walker."""
    bomb = repeated_scan_jpeg(64, 200)
    sos = bomb.index(b"\xff\xda")
    padded = bomb[:sos] + b"\x00garbage\x12" + bomb[sos:]
    found = measure(padded, StructureLimits(max_scans=10**6))
    assert found is not None and found.scans >= 200


def test_png_chunks_are_counted() -> None:
    png = encoded("PNG")
    found = measure(png, LIMITS)
    assert found is not None and found.chunks == 3  # IHDR, IDAT, IEND
    ihdr_end = 8 + 25
    text = b"".join(
        len(b"k\x00v").to_bytes(4, "big") + b"tEXt" + b"k\x00v" + b"\x00\x00\x00\x00"
        for _ in range(100)
    )
    many = png[:ihdr_end] + text + png[ihdr_end:]
    why = too_complex(many, LIMITS)
    assert why is not None and "EPD_MAX_IMAGE_CHUNKS" in why and "PNG" in why


def test_gif_and_webp_blocks_are_counted() -> None:
    frames = [Image.new("RGB", (8, 8), (i, 0, 0)) for i in range(80)]
    for fmt in ("GIF", "WEBP"):
        out = io.BytesIO()
        frames[0].save(out, fmt, save_all=True, append_images=frames[1:], duration=40)
        why = too_complex(out.getvalue(), StructureLimits(max_chunks=16))
        assert why is not None and "EPD_MAX_IMAGE_CHUNKS" in why, fmt
        assert too_complex(encoded(fmt), LIMITS) is None


@pytest.mark.parametrize(
    "data", [b"", b"\xff\xd8", b"\xff\xd8\xff\xda", b"\x89PNG\r\n\x1a\n\x00", b"GIF89a"]
)
def test_truncated_files_leave_the_verdict_to_the_decoder(data: bytes) -> None:
    assert too_complex(data, LIMITS) is None


def test_bmp_has_no_structure_to_count() -> None:
    assert measure(encoded("BMP"), LIMITS) is None


@pytest.mark.parametrize(
    "head",
    [
        b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00",
        b"\xff\xd8\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00",
    ],
    ids=["between-segments", "inside-a-scan"],
)
def test_a_long_run_of_fill_bytes_is_walked_in_linear_time(head: bytes) -> None:
    """A regex that backtracked over 0xFF runs took 8 s for 20 KB of them (holding the GIL)."""
    import time

    t0 = time.process_time()
    assert too_complex(head + b"\xff" * 4_000_000, LIMITS) is None
    assert time.process_time() - t0 < 2.0  # linear: ~0.1 s; quadratic: hours


def test_a_gif_chain_of_one_byte_sub_blocks_is_refused() -> None:
    """Encoders write full 255-byte sub-blocks; millions of one-byte ones are walked one by one
    (by Pillow too), so each counts as a block."""
    screen = b"GIF89a" + b"\x01\x00\x01\x00\x00\x00\x00"
    comment = b"\x21\xfe" + b"\x01a" * 100_000 + b"\x00"
    image = b"\x2c\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02\x44\x01\x00\x3b"
    why = too_complex(screen + comment + image, LIMITS)
    assert why is not None and "EPD_MAX_IMAGE_CHUNKS" in why
    full = b"\x21\xfe" + (b"\xff" + b"a" * 255) * 1000 + b"\x00"  # 255 KB of comment: its bytes
    assert too_complex(screen + full + image, LIMITS) is None
