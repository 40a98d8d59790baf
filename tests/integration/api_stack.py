"""A real API stack for tests: workers (``epd worker``) and ``epd api`` replicas as processes,
on an isolated topic prefix of the test broker and the test Redis DB."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from pydantic import SecretStr

from epd.local_pipeline import WorkerProcesses, worker_env
from runtime.settings import Settings

TOKENS = {"alice": "alice-token", "bob": "bob-token"}
API_TOKENS = ",".join(f"{tok}={tenant}" for tenant, tok in TOKENS.items())


def auth(tenant: str = "alice") -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[tenant]}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ApiProcess:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def rss_bytes(self) -> int:
        import psutil

        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_api(env: Mapping[str, str], log: Path, timeout_s: float = 120.0) -> ApiProcess:
    """``epd api`` on a free loopback port; returns once ``/readyz`` answers 200."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "epd.cli", "api", "--port", str(port), "--log-level", "info"],
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    api = ApiProcess(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"epd api exited with {proc.returncode}:\n{api.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(f"{api.url}/readyz", timeout=5)
            last = r.text
            if r.status_code == 200:
                return api
        time.sleep(0.3)
    api.stop()
    raise TimeoutError(f"epd api not ready after {timeout_s}s: {last}\n{api.tail()}")


@dataclass
class ApiStack:
    settings: Settings
    env: dict[str, str]
    workers: WorkerProcesses
    api: ApiProcess
    replica: ApiProcess
    """Same pipeline and Redis, ``EPD_API_MAX_IN_FLIGHT=2``."""
    extra: list[ApiProcess] = field(default_factory=list)


def isolated(settings: Settings) -> Settings:
    run_id = uuid.uuid4().hex[:8]
    return settings.model_copy(
        update={
            "topic_prefix": f"api-{run_id}",
            # Consumer groups are per broker: a run of its own never rebalances with (or waits
            # on) workers of other runs sharing the broker.
            "group_suffix": f"-{run_id}",
            "ec_namespace": f"ec-{run_id}",
            "ec_secret": SecretStr(secrets.token_hex(16)),
        }
    )


@contextlib.contextmanager
def api_stack(settings: Settings, log_dir: Path) -> Iterator[ApiStack]:
    """Workers + two API replicas (the second with a tiny in-flight bound)."""
    import asyncio

    from runtime.kafka import ensure_topics
    from schemas.topics import Topics

    asyncio.run(ensure_topics(settings, Topics(settings.topic_prefix).all()))
    env = worker_env(settings)
    env.update(
        {
            "EPD_GROUP_SUFFIX": settings.group_suffix,
            "EPD_API_TOKENS": API_TOKENS,
            "EPD_API_MAX_BODY_BYTES": str(4 * 1024 * 1024),
            "EPD_API_MAX_IMAGE_BYTES": str(2 * 1024 * 1024),
            "EPD_LOG_LEVEL": "INFO",
        }
    )
    workers = WorkerProcesses(env, log_dir, ("results", "encode", "prefill"))
    workers.start()
    procs: list[ApiProcess] = []
    try:
        procs.append(start_api(env, log_dir / "api.log"))
        procs.append(start_api({**env, "EPD_API_MAX_IN_FLIGHT": "2"}, log_dir / "api-b.log"))
        asyncio.run(workers.wait_ready())
        yield ApiStack(settings, env, workers, procs[0], procs[1])
    finally:
        for p in procs:
            p.stop()
        workers.stop()
