"""Frame counts and delays of animated GIF / WebP files, read from their block headers.

Pillow reports a GIF frame's delay only after seeking to it, and every seek composites the frame
onto the canvas: reading the delays of a 36,000-frame GIF that way decodes all of it. These
parsers walk the block structure instead (GIF: Graphics Control Extensions and image
descriptors; WebP: ANMF chunks) and never touch pixel data, so a video's duration and frame count
are known before anything is decoded.
"""

from __future__ import annotations


class HeaderError(ValueError):
    """The block structure is broken (truncated or not the format it claims)."""


def _skip_sub_blocks(data: bytes, pos: int) -> int:
    """Position after a GIF data sub-block chain (size byte, data, ..., 0 terminator)."""
    while True:
        if pos >= len(data):
            raise HeaderError("GIF ends inside a data block")
        size = data[pos]
        pos += 1
        if size == 0:
            return pos
        pos += size


def gif_frame_delays(data: bytes) -> list[int]:
    """Delay (ms) of each frame of a GIF, in order: one entry per image descriptor, taken from
    the Graphics Control Extension before it (0 when it has none). Raises :class:`HeaderError`
    on a broken block structure. A GIF that ends without its trailer keeps the frames read."""
    if data[:6] not in (b"GIF87a", b"GIF89a") or len(data) < 13:
        raise HeaderError("not a GIF")
    pos = 13
    if data[10] & 0x80:  # global colour table
        pos += 3 << ((data[10] & 0x07) + 1)
    delays: list[int] = []
    delay = 0
    while pos < len(data):
        kind = data[pos]
        if kind == 0x3B:  # trailer
            break
        if kind == 0x21:  # extension: label, then sub-blocks
            if pos + 2 > len(data):
                raise HeaderError("GIF ends inside an extension")
            if data[pos + 1] == 0xF9 and pos + 8 <= len(data) and data[pos + 2] >= 4:
                delay = int.from_bytes(data[pos + 4 : pos + 6], "little") * 10
            pos = _skip_sub_blocks(data, pos + 2)
        elif kind == 0x2C:  # image descriptor (9 bytes), local colour table, LZW data
            if pos + 11 > len(data):
                raise HeaderError("GIF ends inside an image descriptor")
            packed = data[pos + 9]
            pos += 10
            if packed & 0x80:
                pos += 3 << ((packed & 0x07) + 1)
            pos = _skip_sub_blocks(data, pos + 1)  # the byte skipped: LZW minimum code size
            delays.append(delay)
            delay = 0  # a control extension applies to the one image after it
        else:
            raise HeaderError(f"unknown GIF block 0x{kind:02x} at byte {pos}")
    return delays


def webp_durations(data: bytes) -> list[int]:
    """Per-frame durations (ms) of an animated WebP, from its ANMF chunk headers (no decoding:
    Pillow reports a WebP frame's duration only after decoding it). Empty for a still WebP."""
    out: list[int] = []
    pos = 12  # "RIFF" size "WEBP"
    while pos + 8 <= len(data):
        kind, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        if kind == b"ANMF" and size >= 16:
            out.append(int.from_bytes(data[pos + 20 : pos + 23], "little"))
        pos += 8 + size + (size & 1)
    return out
