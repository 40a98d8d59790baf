"""Untrusted images decoded in child processes that a timeout kills.

A decode in a thread cannot be stopped: when the render's time runs out the thread is abandoned
and goes on burning a core (and holding an executor thread) until the decoder returns, so a few
slow-to-decode files keep a server busy long after their requests were answered. Here each image
is decoded by a small child process (:mod:`media.image_decode_child`: Pillow only, no torch);
when the request's time is up, or its caller goes away, the child is killed and a fresh one takes
its place, so a refused request costs nothing afterwards.

The same limits run in the child as in the renderer's thread
(:func:`media.image_loading.load_image`): structure counts, then the header's pixel count,
then the decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from PIL import Image

from media.image_decode_child import HEADER, frame
from media.image_loading import ImageLimits
from media.pictures import ErrorFactory

log = logging.getLogger(__name__)

_ROOT = str(Path(__file__).resolve().parents[1])
"""The directory holding the ``producers`` package, put on the child's path."""


READ_LIMIT = 1 << 22
"""The answer stream's buffer: asyncio's default (64 KiB) pauses the pipe several times for
one image's pixels."""


class DecodeTimedOut(Exception):
    """The image was still decoding when its time ran out (its process was killed)."""


class _Child:
    """One decode process and its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def start(cls) -> _Child:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "media.image_decode_child",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=READ_LIMIT,
        )
        return cls(proc)

    async def ask(self, request: bytes) -> tuple[dict[str, object], bytes]:
        """Send one request frame and read its answer."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(request)
        await self.proc.stdin.drain()
        head = await self.proc.stdout.readexactly(HEADER.size)
        meta_len, payload_len = HEADER.unpack(head)
        meta = json.loads(await self.proc.stdout.readexactly(meta_len))
        payload = await self.proc.stdout.readexactly(payload_len)
        return meta, payload

    def kill(self) -> None:
        """End the process now (it is reaped in the background)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None


class ImageDecoder:
    """Decodes encoded images in up to ``processes`` child processes at once."""

    def __init__(self, limits: ImageLimits, processes: int) -> None:
        self.limits = limits
        self.processes = max(1, processes)
        self._slots = asyncio.Semaphore(self.processes)
        self._idle: list[_Child] = []
        self._reaping: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.killed = 0
        """Children killed mid-decode (out of time, caller gone, or died): for tests."""

    async def start(self) -> None:
        """Start the processes ahead of the first image (else they start on demand)."""
        while len(self._idle) < self.processes:
            self._idle.append(await _Child.start())

    async def close(self) -> None:
        """End every idle process."""
        self._closed = True
        for task in list(self._reaping):
            task.cancel()
        idle, self._idle = self._idle, []
        for child in idle:
            if child.proc.stdin is not None:
                child.proc.stdin.close()
            child.kill()
            with contextlib.suppress(Exception):
                await child.proc.wait()

    async def decode(
        self,
        data: bytes | bytearray | memoryview,
        make: ErrorFactory,
        give_up_at: float | None = None,
    ) -> Image.Image:
        """``data`` as an upright RGB image; refusals are ``make(rule, message)``, running past
        ``give_up_at`` (a ``time.monotonic()``) raises :class:`DecodeTimedOut`."""
        request = frame(
            {
                "max_pixels": self.limits.max_pixels,
                "max_scans": self.limits.structure.max_scans,
                "max_chunks": self.limits.structure.max_chunks,
            },
            bytes(data),
        )
        async with self._slots:
            if give_up_at is not None and time.monotonic() >= give_up_at:
                raise DecodeTimedOut()  # no child is killed for an image never sent
            child = await self._take()
            try:
                left = None if give_up_at is None else max(0.0, give_up_at - time.monotonic())
                meta, pixels = await asyncio.wait_for(child.ask(request), left)
            except TimeoutError:
                self._discard(child)
                raise DecodeTimedOut() from None
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
                self._discard(child)
                raise make(
                    "render.image_unreadable", "cannot decode image: its decoder process died"
                ) from None
            except BaseException:  # the caller went away: the decode must not go on
                self._discard(child)
                raise
            self._idle.append(child)
        if not meta.get("ok"):
            raise make(str(meta.get("rule")), str(meta.get("message")))
        size = (int(str(meta["width"])), int(str(meta["height"])))
        return Image.frombytes("RGB", size, pixels)

    async def _take(self) -> _Child:
        while self._idle:
            child = self._idle.pop()
            if child.alive:
                return child
            self._background(child.proc.wait())  # died idle: reaped
        return await _Child.start()

    def _discard(self, child: _Child) -> None:
        """Kill ``child`` (its decode may still be running) and reap it in the background."""
        child.kill()
        self.killed += 1
        self._background(child.proc.wait())
        self._background(self._spare())

    async def _spare(self) -> None:
        """A process in place of a killed one, started now so the next image does not wait."""
        child = await _Child.start()
        if len(self._idle) < self.processes and not self._closed:
            self._idle.append(child)
        else:
            child.kill()
            await child.proc.wait()

    def _background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(work)
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
