"""``epd demo --engine vllm``: the demo's workers driving vLLM instances.

With ``EPD_VLLM_PREFILL_URL`` and ``EPD_VLLM_ENCODE_URL`` set, those (live) instances serve it.
Without them the demo starts the stand-in built from vLLM 0.33.0's code
(``tests/vllm_standin.py``, a source checkout's, with vLLM's code assembled by
``tools/vllm-side.sh``): vLLM's own request and response models, a stub engine, an EC producer
that writes the entries into our store. It is not a live vLLM, and the demo says so.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.settings import Settings

REPO = Path(__file__).resolve().parents[2]
STANDIN = REPO / "tests" / "vllm_standin.py"
STANDIN_LABEL = "stand-in built from vLLM 0.33.0's code, not a live vLLM"
START_S = 90.0


class VllmUnavailableForDemo(RuntimeError):
    """Neither live vLLM URLs nor the stand-in: the message says what to do."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    import httpx

    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise VllmUnavailableForDemo(
                f"the vLLM stand-in exited ({proc.returncode}); is vLLM 0.33.0's code assembled "
                f"(tools/vllm-side.sh)? Its log ({log}):\n{tail}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        time.sleep(0.2)
    raise VllmUnavailableForDemo(f"the vLLM stand-in did not answer in {START_S:.0f}s ({log})")


@contextlib.contextmanager
def vllm_instances(settings: Settings, log_dir: Path) -> Iterator[tuple[dict[str, str], str]]:
    """The settings that point the workers at vLLM, and what serves them (for the output)."""
    if settings.vllm_prefill_url and settings.vllm_encode_url:
        yield (
            {},
            f"vLLM at {settings.vllm_prefill_url} (prefill/decode), "
            f"{settings.vllm_encode_url} (encode)",
        )
        return
    if not STANDIN.exists():
        raise VllmUnavailableForDemo(
            "--engine vllm needs EPD_VLLM_PREFILL_URL and EPD_VLLM_ENCODE_URL (live vLLM "
            "instances), or a source checkout for the stand-in (tests/vllm_standin.py)"
        )
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "vllm-standin.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, "-m", "tests.vllm_standin", "--port", str(port)]
    argv += ["--store-url", settings.embedding_store_url]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, url, log)
        yield {"vllm_prefill_url": url, "vllm_encode_url": url}, f"{STANDIN_LABEL}, at {url}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
