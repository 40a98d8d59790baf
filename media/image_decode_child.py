"""The decode process: reads encoded images on stdin, writes upright RGB pixels on stdout.

Run by :class:`media.image_decoder.ImageDecoder` as ``python -m media.image_decode_child``;
one image at a time, for as long as its parent keeps the pipes open. It imports Pillow and numpy
only (no torch), so it starts in a fraction of a second and a killed one is replaced cheaply.

Wire format, both ways: an 8-byte header (two little-endian uint32: the length of a JSON object,
then the length of a binary payload), the JSON, the payload. No pickle: the parent trusts nothing
but these lengths, the JSON and raw pixel bytes.

- request: ``{"max_pixels", "max_scans", "max_chunks"}`` + the encoded image;
- answer: ``{"ok": true, "width", "height"}`` + ``width * height * 3`` RGB bytes, or
  ``{"ok": false, "rule", "message"}`` + nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import struct
import sys
from typing import Any, BinaryIO

HEADER = struct.Struct("<II")


class Refusal(Exception):
    """A refusal with its rule, as the parent will raise it."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(message)
        self.rule = rule
        self.message = message


def read_frame(stream: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    """One ``(json, payload)`` frame, or None at the end of the stream."""
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    meta_len, payload_len = HEADER.unpack(head)
    meta = stream.read(meta_len)
    payload = stream.read(payload_len)
    if len(meta) < meta_len or len(payload) < payload_len:
        return None
    return json.loads(meta), payload


def frame(meta: dict[str, Any], payload: bytes = b"") -> bytes:
    """One frame's bytes."""
    text = json.dumps(meta).encode()
    return HEADER.pack(len(text), len(payload)) + text + payload


def decode(meta: dict[str, Any], data: bytes) -> bytes:
    """The answer frame for one request."""
    from media.image_loading import ImageLimits, load_image
    from media.image_structure import StructureLimits

    limits = ImageLimits(
        int(meta["max_pixels"]), StructureLimits(int(meta["max_scans"]), int(meta["max_chunks"]))
    )
    try:
        img = load_image(data, limits, Refusal)
    except Refusal as r:
        return frame({"ok": False, "rule": r.rule, "message": r.message})
    except Exception as e:  # a decoder failure Pillow does not map: the image's fault still
        return frame(
            {"ok": False, "rule": "render.image_unreadable", "message": f"cannot decode image: {e}"}
        )
    w, h = img.size
    return frame({"ok": True, "width": w, "height": h}, img.tobytes())


PIPE_BYTES = 1 << 20
"""The pipes' size asked for (Linux's default most a process may ask): a 224² image's pixels
(150 KB) pass in one write and one read, not three of each with a wake-up between."""


def _widen_pipes(*streams: BinaryIO) -> None:
    """Ask for :data:`PIPE_BYTES` on each pipe (Linux; elsewhere, or refused, they stay)."""
    for stream in streams:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            fcntl.fcntl(stream.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)


def main() -> None:
    """Serve requests until stdin closes."""
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing printed by a library may corrupt the answer stream
    _widen_pipes(requests, answers)
    while (got := read_frame(requests)) is not None:
        answers.write(decode(*got))
        answers.flush()


if __name__ == "__main__":
    main()
