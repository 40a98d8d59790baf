"""What an encoded image will cost to decode, read from its container structure alone.

The pixel-count check (:func:`media.pictures` callers, from the header) bounds the memory a
decode needs, not the time: a progressive JPEG can repeat its last scan thousands of times
(about 33 bytes each), and every scan makes the decoder pass over every block of the image, so a
100 KB file can take seconds. PNG, WebP and GIF files can likewise hold a huge number of tiny
chunks or blocks that Pillow walks one by one in Python. These walkers count the scans, segments,
chunks and blocks without decoding anything, so such a file is refused before any decoder sees it.

The walkers follow the decoders' own way of finding structure (libjpeg resynchronises on the next
``0xFF`` marker after garbage, so does the JPEG walker), so a file cannot hide a scan from them
that the decoder would still run. A walker that cannot make sense of a file says nothing: the
decoder refuses broken files itself, with its own message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the decode processes import this module: they need no settings
    from runtime.settings import Settings

_JPEG_MARKER = re.compile(rb"\xff([^\x00\xff])")
"""A JPEG marker as libjpeg finds one: 0xFF, then a byte that is neither 0x00 (a stuffed 0xFF
inside entropy-coded data) nor 0xFF (fill bytes before a marker: the last one is matched).
No ``+`` after the first byte: on a long run of 0xFF that would backtrack quadratically."""
_JPEG_SCAN_END = re.compile(rb"\xff([^\x00\xff\xd0-\xd7])")
"""The marker that ends a scan's entropy-coded data (restart markers RST0-7 are inside it)."""
_SOS, _EOI = 0xDA, 0xD9
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
"""Markers without a length field (TEM, RST0-7)."""


@dataclass(frozen=True, slots=True)
class StructureLimits:
    """How much structure one encoded image may have (``EPD_MAX_IMAGE_SCANS``,
    ``EPD_MAX_IMAGE_CHUNKS``)."""

    max_scans: int = 100
    """Scans of a JPEG (a baseline one has 1, a progressive one about 10)."""
    max_chunks: int = 16384
    """Marker segments of a JPEG, chunks of a PNG or WebP, blocks of a GIF."""

    @classmethod
    def from_settings(cls, settings: Settings) -> StructureLimits:
        """The deployment's ``EPD_MAX_IMAGE_SCANS`` and ``EPD_MAX_IMAGE_CHUNKS``."""
        return cls(max_scans=settings.max_image_scans, max_chunks=settings.max_image_chunks)


@dataclass(frozen=True, slots=True)
class Structure:
    """What a walker counted: ``units`` (scans for JPEG, else 0) and ``chunks``."""

    format: str
    scans: int = 0
    chunks: int = 0


def too_complex(data: bytes | bytearray | memoryview, limits: StructureLimits) -> str | None:
    """Why ``data`` would cost too much to decode (one sentence naming the count, the limit and
    its setting), or None. Reads only container structure; stops counting at the limit."""
    found = measure(bytes(data) if not isinstance(data, bytes) else data, limits)
    if found is None:
        return None
    if found.scans > limits.max_scans:
        return (
            f"the {found.format} has more than {limits.max_scans} scans (each one makes the "
            f"decoder pass over the whole image); the limit is {limits.max_scans} "
            "(EPD_MAX_IMAGE_SCANS)"
        )
    if found.chunks > limits.max_chunks:
        kind = (
            "blocks"
            if found.format == "GIF"
            else "segments"
            if found.format == "JPEG"
            else "chunks"
        )
        return (
            f"the {found.format} has more than {limits.max_chunks} {kind}; the limit is "
            f"{limits.max_chunks} (EPD_MAX_IMAGE_CHUNKS)"
        )
    return None


def measure(data: bytes, limits: StructureLimits) -> Structure | None:
    """The structure of a JPEG, PNG, WebP or GIF file, counted up to one past each limit; None
    for any other format (BMP has no structure worth counting: its cost is its pixels)."""
    if data[:2] == b"\xff\xd8":
        return _jpeg(data, limits)
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png(data, limits)
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp(data, limits)
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(data, limits)
    return None


def _jpeg(data: bytes, limits: StructureLimits) -> Structure:
    scans = segments = 0
    pos = 2
    while scans <= limits.max_scans and segments <= limits.max_chunks:
        found = _JPEG_MARKER.search(data, pos)
        if found is None:
            break
        marker, pos = found.group(1)[0], found.end()
        if marker == _EOI:
            break
        if marker in _STANDALONE:
            continue
        segments += 1
        if pos + 2 > len(data):
            break
        pos += int.from_bytes(data[pos : pos + 2], "big")
        if marker == _SOS:
            scans += 1
            end = _JPEG_SCAN_END.search(data, pos)
            if end is None:
                break
            pos = end.start()
    return Structure("JPEG", scans=scans, chunks=segments)


def _png(data: bytes, limits: StructureLimits) -> Structure:
    chunks = 0
    pos = 8
    while pos + 8 <= len(data) and chunks <= limits.max_chunks:
        size = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        chunks += 1
        pos += 12 + size  # length, type, data, CRC
        if kind == b"IEND":
            break
    return Structure("PNG", chunks=chunks)


def _webp(data: bytes, limits: StructureLimits) -> Structure:
    chunks = 0
    pos = 12
    while pos + 8 <= len(data) and chunks <= limits.max_chunks:
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        chunks += 1
        pos += 8 + size + (size & 1)
    return Structure("WebP", chunks=chunks)


def _gif(data: bytes, limits: StructureLimits) -> Structure:
    """Extension and image blocks (each data sub-block chain counted once with its block)."""
    if len(data) < 13:
        return Structure("GIF")
    blocks = 0
    pos = 13
    if data[10] & 0x80:
        pos += 3 << ((data[10] & 0x07) + 1)
    while pos < len(data) and blocks <= limits.max_chunks:
        kind = data[pos]
        if kind == 0x21:
            pos, short = _gif_sub_blocks(data, pos + 2, limits.max_chunks - blocks)
        elif kind == 0x2C:
            if pos + 10 > len(data):
                break
            packed = data[pos + 9]
            pos += 10
            if packed & 0x80:
                pos += 3 << ((packed & 0x07) + 1)
            pos, short = _gif_sub_blocks(data, pos + 1, limits.max_chunks - blocks)
        else:
            break  # the trailer, or bytes the decoder stops at too
        blocks += 1 + short
    return Structure("GIF", chunks=blocks)


def _gif_sub_blocks(data: bytes, pos: int, budget: int) -> tuple[int, int]:
    """Position after a chain of data sub-blocks (size byte, data; a 0 ends it), and how many
    of them were short. Encoders write full 255-byte sub-blocks, a chain's last one aside, and
    their cost is their bytes; short ones count as blocks (a chain of millions of one-byte
    sub-blocks is walked one by one, by this loop as by Pillow), the walk stopping past
    ``budget`` of them."""
    short = 0
    while pos < len(data) and short <= budget:
        size = data[pos]
        pos += 1 + size
        if size == 0:
            break
        if size < 255:
            short += 1
    return pos, short
