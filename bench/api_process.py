"""``epd api`` in a process of its own, on a free loopback port (the benchmarks that go through
the HTTP API start one beside their workers)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def image_b64(seed: int) -> str:
    """A small synthetic PNG, base64 (one per request: each is a new image to the encoder)."""
    from media.sample_images import png_bytes, synthetic_image

    return base64.b64encode(png_bytes(synthetic_image(56, 56, seed=seed))).decode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ApiProcess:
    """``epd api`` in a process of its own, on a free loopback port."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "epd.cli", "api", "--port", port, "--log-level", "warning"],
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    async def ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"epd api exited with {self.proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.url}/readyz", timeout=5)).status_code == 200:
                        return
                await asyncio.sleep(0.3)
        raise TimeoutError("epd api not ready")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
