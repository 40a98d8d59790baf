"""Worker processes on this machine (demo, verify, end-to-end tests): start, watch, stop."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from pydantic import SecretStr

from runtime.settings import Settings, env_names

if TYPE_CHECKING:
    from producers.submitter import Submitter
    from runtime.kafka import KafkaPublisher

DEFAULT_WORKERS = ("results", "encode", "prefill")


def worker_kinds(settings: Settings) -> tuple[str, ...]:
    """The workers a local pipeline runs: results, encode, prefill, and (``EPD_DECODE_STAGE``)
    a decode worker."""
    return (*DEFAULT_WORKERS, "decode") if settings.decode_stage else DEFAULT_WORKERS


class WorkerDied(RuntimeError):
    """A worker process exited while it should be running; the message holds its log's tail,
    :attr:`summary` one line (the log's last line: the worker's own word on why)."""

    def __init__(self, kind: str, code: int, log_path: Path) -> None:
        tail = log_path.read_text(errors="replace")[-3000:]
        super().__init__(f"{kind} worker exited with {code}; log tail:\n{tail}")
        last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
        cause = f": {last.strip().removeprefix('epd: ')}" if last else ""
        self.summary = f"the {kind} worker exited with {code}{cause} (log: {log_path})"


class WorkerProcesses:
    """One OS process per worker (``epd worker KIND``), logs in ``log_dir``."""

    def __init__(
        self,
        env: Mapping[str, str],
        log_dir: Path,
        kinds: Sequence[str] = DEFAULT_WORKERS,
    ) -> None:
        self.env = child_env(env)
        self.log_dir = log_dir
        self.kinds = list(kinds)
        self.procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        self.ready_files: list[Path] = []
        self.retired: set[int] = set()
        """Workers stopped on purpose for good (:meth:`retire`): no longer expected alive."""

    def start(self) -> None:
        """Spawn every worker; they join their consumer groups on their own."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for i, kind in enumerate(self.kinds):
            ready = self.log_dir / f"{kind}-{i}.ready"
            self.ready_files.append(ready)
            self.procs.append((kind, *self._spawn(kind, i)))

    def _spawn(self, kind: str, i: int) -> tuple[subprocess.Popen[bytes], Path]:
        log_path = self.log_dir / f"{kind}-{i}.log"
        ready = self.log_dir / f"{kind}-{i}.ready"
        ready.unlink(missing_ok=True)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "epd.cli", "worker", kind, "--ready-file", str(ready)],
                # In the environment, not a flag: a checkout that predates it just runs.
                env={**self.env, "EPD_EXIT_WITH_PARENT": str(os.getpid())},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return proc, log_path

    def indices(self, kind: str) -> list[int]:
        """Positions of the workers of ``kind`` (for :meth:`kill` and :meth:`restart`)."""
        return [i for i, (k, _, _) in enumerate(self.procs) if k == kind]

    def kill(self, index: int, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (default: a hard kill) to worker ``index`` and reap it; its exit code."""
        _, proc, _ = self.procs[index]
        if proc.poll() is None:
            proc.send_signal(sig)
        return proc.wait(30)

    async def restart(self, index: int, timeout_s: float = 180.0) -> None:
        """Start worker ``index`` again (after :meth:`kill`) and wait until it holds partitions."""
        kind, proc, _ = self.procs[index]
        if proc.poll() is None:
            raise RuntimeError(f"{kind} worker {index} is still running")
        self.procs[index] = (kind, *self._spawn(kind, index))
        await self._until_ready(index, timeout_s)

    async def add(self, kind: str, timeout_s: float = 180.0) -> int:
        """Start one more worker of ``kind`` (it joins its group: a rebalance); once it holds
        partitions, its index."""
        index = len(self.procs)
        self.ready_files.append(self.log_dir / f"{kind}-{index}.ready")
        self.procs.append((kind, *self._spawn(kind, index)))
        await self._until_ready(index, timeout_s)
        return index

    def respawn(self, index: int) -> None:
        """Start worker ``index`` again after it died, without waiting for it (a supervisor
        watches its ready file)."""
        kind, proc, _ = self.procs[index]
        if proc.poll() is None:
            raise RuntimeError(f"{kind} worker {index} is still running")
        self.procs[index] = (kind, *self._spawn(kind, index))

    def exited(self) -> list[int]:
        """Indices of the workers that exited (retired ones aside)."""
        return [
            i
            for i, (_, proc, _) in enumerate(self.procs)
            if i not in self.retired and proc.poll() is not None
        ]

    def retire(self, index: int) -> int:
        """Stop worker ``index`` for good with SIGTERM (a graceful leave: it drains, commits and
        leaves its group); its exit code."""
        self.retired.add(index)
        return self.kill(index, signal.SIGTERM)

    async def _until_ready(self, index: int, timeout_s: float) -> None:
        kind = self.procs[index][0]
        deadline = time.monotonic() + timeout_s
        while not self.ready_files[index].exists():
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} worker {index} not ready after {timeout_s}s")
            await asyncio.sleep(0.2)

    def check_alive(self) -> None:
        """Raise WorkerDied (with the log's tail) when a worker has exited (retired ones aside)."""
        for i, (kind, proc, log_path) in enumerate(self.procs):
            if i in self.retired:
                continue
            if proc.poll() is not None:
                raise WorkerDied(kind, proc.returncode, log_path)

    async def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Until every worker has loaded its model and holds partitions (WorkerDied/TimeoutError).

        Checked a few times a second: this runs once, at start-up, not on a request path.
        """
        deadline = time.monotonic() + timeout_s
        while not all(f.exists() for f in self.ready_files):
            self.check_alive()
            if time.monotonic() > deadline:
                waiting = [f.stem for f in self.ready_files if not f.exists()]
                raise TimeoutError(f"workers not ready after {timeout_s}s: {waiting}")
            await asyncio.sleep(0.2)

    def stop(self, timeout_s: float = 20.0) -> dict[str, int | None]:
        """SIGTERM everyone (graceful drain), then SIGKILL stragglers. Returns exit codes."""
        for _, proc, _ in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes: dict[str, int | None] = {}
        for i, (kind, proc, _) in enumerate(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            codes[f"{kind}-{i}"] = proc.returncode
        self.procs.clear()
        self.ready_files.clear()
        self.retired.clear()
        return codes

    def __enter__(self) -> WorkerProcesses:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def worker_env(settings: Settings) -> dict[str, str]:
    """The EPD_* variables that make a worker process see exactly ``settings`` (all of them)."""
    return settings.to_env()


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with every setting replaced by ``env``'s.

    Inherited ``EPD_*`` settings are dropped first, so a setting that is unset in ``env`` (e.g. no
    EC secret) is unset in the child too instead of leaking in from the parent.
    """
    names = env_names()
    return {**{k: v for k, v in os.environ.items() if k not in names}, **env}


@dataclass
class LocalRun:
    """A pipeline reachable from this process: settings, a submitter, and maybe workers."""

    settings: Settings
    submitter: Submitter
    publisher: KafkaPublisher
    workers: WorkerProcesses | None


@contextlib.asynccontextmanager
async def local_pipeline(
    settings: Settings,
    *,
    spawn_workers: bool,
    log_dir: Path,
    isolate: bool = True,
    kinds: Sequence[str] | None = None,
) -> AsyncIterator[LocalRun]:
    """Connect to the pipeline in ``settings``; with ``spawn_workers`` also run its workers here
    (``kinds``, default :func:`worker_kinds`).

    ``isolate`` gives this run its own topic prefix, embedding namespace and EC secret, so
    reruns against a long-lived broker and Redis never see each other's events or embeddings.
    """
    from producers.submitter import Submitter
    from runtime.kafka import KafkaPublisher, ensure_topics
    from runtime.model import load_render_info
    from runtime.redis.client import redis_client
    from runtime.status import StatusStore
    from runtime.stores import open_store
    from schemas.topics import Topics

    if isolate:
        run_id = uuid.uuid4().hex[:8]
        settings = settings.model_copy(
            update={
                "topic_prefix": f"{settings.topic_prefix}-{run_id}",
                "ec_namespace": f"{settings.ec_namespace}-{run_id}",
                "ec_secret": SecretStr(secrets.token_hex(16)),
            }
        )
    topics = Topics(settings.topic_prefix)
    await ensure_topics(settings, topics.all())
    kinds = worker_kinds(settings) if kinds is None else kinds
    workers = WorkerProcesses(worker_env(settings), log_dir, kinds) if spawn_workers else None
    if workers is not None:
        workers.start()
    publisher = KafkaPublisher.for_pipeline(settings, topics)
    store = open_store(settings.embedding_store_url)
    client = redis_client(settings)
    try:
        await publisher.start()
        info = await asyncio.to_thread(load_render_info, settings.model)
        status = StatusStore.for_settings(client, settings)
        submitter = Submitter.for_pipeline(
            settings, info, store=store, publisher=publisher, status=status
        )
        if workers is not None:
            await workers.wait_ready()
        yield LocalRun(settings, submitter, publisher, workers)
    finally:
        if workers is not None:
            # Up to its drain timeout (20 s): in a thread, so this loop's other tasks run on.
            await asyncio.to_thread(workers.stop)
        await publisher.stop()
        await store.close()
        await client.aclose()
