"""The image decoder's child answers through a pipe that holds a whole image's pixels."""

from __future__ import annotations

import fcntl
import io
import os
from pathlib import Path

from media.image_decode_child import PIPE_BYTES
from media.image_decoder import ImageDecoder
from media.image_loading import ImageLimits
from media.sample_images import synthetic_image
from producers.render_errors import image_error


def _pipe_bytes(pid: int, fd: int) -> int:
    """The size of the pipe ``pid`` holds as ``fd`` (opened through /proc, without blocking)."""
    opened = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
    try:
        return int(fcntl.fcntl(opened, fcntl.F_GETPIPE_SZ))
    finally:
        os.close(opened)


def _pipe_max() -> int:
    """The most an unprivileged process may ask for a pipe (Linux's pipe-max-size)."""
    return int(Path("/proc/sys/fs/pipe-max-size").read_text())


async def test_a_224_image_passes_in_one_pipe_fill() -> None:
    buf = io.BytesIO()
    synthetic_image(224, 224, seed=1).save(buf, format="PNG")
    decoder = ImageDecoder(ImageLimits(max_pixels=4096 * 4096), 1)
    try:
        image = await decoder.decode(buf.getvalue(), image_error(0))
        assert image.size == (224, 224)
        (child,) = decoder._idle  # the one process, idle again after its answer
        pid = child.proc.pid
        want = min(PIPE_BYTES, _pipe_max())
        assert _pipe_bytes(pid, 1) >= want > 224 * 224 * 3
        assert _pipe_bytes(pid, 0) >= want
    finally:
        await decoder.close()
