"""``epd api``: serve the HTTP submit-and-poll API (FastAPI on uvicorn)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from types import FrameType
from typing import Any

import uvicorn

DESCRIPTION = """\
Serve the HTTP front door of the pipeline:

  POST   /v1/requests              submit (JSON with base64/data: URL images, or multipart);
                                   202 {request_id, status_url, events_url} without waiting
  GET    /v1/requests/{id}         status, per-stage timings, result; ?wait=S long-polls
  GET    /v1/requests/{id}/events  Server-Sent Events: status changes and tokens as they come
  DELETE /v1/requests/{id}         cancel
  POST   /v1/vllm/generate         fan out a vLLM render response
  POST   /v1/chat/completions      OpenAI chat completions (plain, or streamed as SSE chunks)
  POST   /v1/responses             OpenAI responses (background: queued at once, then poll)
  GET    /v1/responses/{id}        ... and POST /v1/responses/{id}/cancel
  GET    /v1/models                the served model (EPD_SERVED_MODEL_NAME, else EPD_MODEL)
  GET    /healthz /readyz /metrics /docs /openapi.json

Configuration comes from EPD_* variables (Kafka, Redis, model, EPD_API_* limits). Set
EPD_API_TOKENS=TOKEN=TENANT,... (or EPD_API_TOKENS_FILE=PATH, one pair per line) to require
bearer tokens; without either the API is open. EPD_EC_SECRET is required, as for the workers
(it signs embedding entries and keys tenant salts). A malformed setting stops the API before
it starts (exit 2, the variable named). Replicas (--workers, or several hosts) share every
piece of state through Redis. Image and video URLs are fetched only from the hosts of
EPD_API_IMAGE_URL_HOSTS (none by default: data: URLs only).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "api",
        help="serve the HTTP submit-and-poll API",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--host", default=os.environ.get("EPD_API_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(os.environ.get("EPD_API_PORT", "8000")))
    p.add_argument(
        "--workers", type=int, default=1, help="uvicorn worker processes (each a full replica)"
    )
    p.add_argument("--log-level", default=os.environ.get("EPD_LOG_LEVEL", "info"))
    p.set_defaults(func=run)


class QuietServer(uvicorn.Server):
    """uvicorn's server, woken once a second instead of ten times when idle.

    uvicorn's main loop sleeps 100 ms between ticks only to refresh the ``Date`` header once a
    second and to notice a shutdown; here each tick waits up to a second (the header is still
    refreshed every tick: its resolution is a second) and a shutdown signal ends the wait at
    once. (``--workers`` N > 1 runs uvicorn's own server in each worker process.)
    """

    TICK_S = 1.0

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        # (The start-up heap was frozen by the app's lifespan: frontend.api.process_app.)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # on_tick refreshes the header when % 10 == 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.TICK_S)
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)


def serve(config: uvicorn.Config) -> int:
    """Serve ``config`` with :class:`QuietServer` in this process (``uvicorn.run`` for one
    worker); 3 (uvicorn's start-up failure status) when it did not start."""
    server = QuietServer(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    return 0 if server.started else 3


def run(args: argparse.Namespace) -> int:
    import logging

    from runtime import event_loop
    from runtime.settings import Settings

    # Checked here, before uvicorn starts (or forks workers): a bad setting is one line, not a
    # traceback per worker. Settings() validates the tokens; the secret is checked as the
    # workers check theirs (InsecureSettings: the message, exit 1).
    settings = Settings()
    settings.require_signing("api")

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    options: dict[str, Any] = {
        "factory": True,
        "loop": event_loop.loop_name(settings.event_loop),
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level.lower(),
        # Long-polls and event streams hold connections open; keep idle ones short.
        "timeout_keep_alive": 5,
        "timeout_graceful_shutdown": 10,
    }
    if args.workers > 1:  # uvicorn's supervisor and its own server in each worker process
        uvicorn.run("frontend.api:app_factory", workers=args.workers, **options)
        return 0
    return serve(uvicorn.Config("frontend.api:app_factory", **options))
