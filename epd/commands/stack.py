"""``epd stack``: the whole local pipeline in one command, the HTTP API in the foreground.

A broker and Redis of its own (``epd services``: Apache Kafka where Java 17+ is there, else
Tansu; ``EPD_KAFKA_BOOTSTRAP`` / ``EPD_REDIS_URL`` name existing ones instead), the topics, a
one-run EC secret unless ``EPD_EC_SECRET`` is set, the results, encode, prefill and router
workers, then ``epd api`` in this process. It says ``ready`` once the API answers ``/readyz``
with every worker holding its partitions. A worker that dies is said on the console and
started again (with a growing backoff; ``/readyz`` shows the gap meanwhile). Ctrl-C (or
SIGTERM) stops the API, then the workers, then the services it started, and nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import uvicorn

from epd.commands.api import QuietServer

STACK_WORKERS = ("results", "encode", "prefill", "router")

DESCRIPTION = """\
Run the whole local stack with the HTTP API in the foreground: a broker and Redis (started
here unless EPD_KAFKA_BOOTSTRAP / EPD_REDIS_URL name running ones), the topics, a generated
EC secret (unless EPD_EC_SECRET is set), the results, encode, prefill and router workers, and
the API on --host/--port. Prints "ready" with the API's URL once requests can complete.
Ctrl-C stops everything it started (and nothing else). Without EPD_API_TOKENS the API is open.
"""


def say(msg: str) -> None:
    """Progress on stdout, flushed (a caller waiting for "ready" reads it line by line)."""
    print(f"epd stack: {msg}", flush=True)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "stack",
        help="run broker, Redis, topics, workers and the API (in the foreground) in one command",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default=os.environ.get("EPD_API_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("EPD_API_PORT", "8000")))
    p.add_argument("--model", default=None, help="EPD_MODEL for the workers and the API")
    p.add_argument("--log-level", default=os.environ.get("EPD_LOG_LEVEL", "warning"))
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where service and worker logs go (default $EPD_STATE_DIR or ./.epd)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from epd import services
    from runtime import event_loop
    from runtime.model import model_family
    from runtime.settings import Settings

    # A bad setting or an unknown model is one line and exit 2 (epd.cli), before anything starts.
    model_family(args.model or Settings().model)
    if not _port_free(args.host, args.port):
        print(f"epd stack: error: {args.host}:{args.port} is in use; give --port", file=sys.stderr)
        return 1
    directory = services.state_dir(args.state_dir)
    log_dir = directory / f"stack-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        with services.running(directory, log_dir=log_dir) as state:
            for note in state.notes:
                say(note)
            say(f"broker {state.kafka.address}, Redis {state.redis.address} (logs in {log_dir})")
            os.environ.update(state.env)  # the settings below and the workers read them
            settings = _stack_settings(args)
            return event_loop.run(_serve(args, settings, log_dir), settings.event_loop)
    except services.ServiceError as exc:
        print(f"epd stack: error: {exc}", file=sys.stderr)
        return 1
    finally:
        say("stopped")


def _stack_settings(args: argparse.Namespace) -> Any:
    from pydantic import SecretStr

    from runtime.settings import Settings

    settings = Settings(**({"model": args.model} if args.model else {}))
    if settings.ec_secret is None and not settings.allow_unsigned:
        # One secret for this run, shared by the API and the workers (they get it through
        # their environment); set EPD_EC_SECRET to keep one across runs.
        settings = settings.model_copy(update={"ec_secret": SecretStr(secrets.token_hex(32))})
        say("generated an EC secret for this run (set EPD_EC_SECRET to choose one)")
    return settings


async def _serve(args: argparse.Namespace, settings: Any, log_dir: Path) -> int:
    from epd.local_pipeline import WorkerProcesses, worker_env
    from frontend.api import process_app
    from runtime.kafka import ensure_topics
    from schemas.topics import Topics

    await ensure_topics(settings, Topics(settings.topic_prefix).all())
    workers = WorkerProcesses(worker_env(settings), log_dir / "workers", STACK_WORKERS)
    workers.start()
    try:
        say(f"started {', '.join(STACK_WORKERS)} workers; waiting for them to hold partitions")
        await workers.wait_ready()
        server = _Server(_uvicorn_config(args, process_app(settings)))
        url = f"http://{args.host}:{args.port}"
        announce = asyncio.create_task(_announce_when_ready(url, server))
        async with _supervised(workers, settings):
            try:
                await server.serve()
            finally:
                announce.cancel()
    finally:
        say("stopping the workers and the services this stack started")
        workers.stop()
    return 0


@contextlib.asynccontextmanager
async def _supervised(workers: Any, settings: Any) -> AsyncIterator[None]:
    """Workers that die are said, taken out of the fleet and restarted (:mod:`epd.supervisor`)
    while the API serves; the supervision ends before the workers are stopped."""
    from epd.supervisor import Supervisor
    from runtime.fleet.board import FleetBoard
    from runtime.redis.client import redis_client
    from runtime.status import StatusStore

    client = redis_client(settings)
    status = StatusStore.for_settings(client, settings)
    supervisor = Supervisor(workers, say, FleetBoard(client, status.keys))
    task = asyncio.create_task(supervisor.run(), name="supervisor")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.aclose()


def _uvicorn_config(args: argparse.Namespace, app: Any) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        # Long-polls and event streams hold connections open; keep idle ones short.
        timeout_keep_alive=5,
        timeout_graceful_shutdown=10,
    )


async def _announce_when_ready(url: str, server: Any) -> None:
    """Print ``ready`` once ``/readyz`` answers 200 (broker, topics, Redis, notifications)."""
    import httpx

    async with httpx.AsyncClient(timeout=5) as http:
        while not server.should_exit:
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    say(f"ready: {url} (docs {url}/docs); Ctrl-C stops the stack")
                    return
            await asyncio.sleep(0.25)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class _Server(QuietServer):
    """The API's quiet server (``epd api``), keeping the Ctrl-C it shut down on.

    uvicorn re-raises the signal it stopped for once its shutdown is done, so the default action
    would end this process before the workers and services are stopped; here the signal only
    starts the API's graceful shutdown, and ``_serve`` carries on with the rest.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
