"""``epd worker {encode,prefill,decode,results,router}``: run one pipeline stage until SIGTERM.

Parses arguments only: the stages themselves and :func:`~epd.stages.run_worker` live in
:mod:`epd.stages`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from epd.stages import KINDS, STAGES, run_worker
from schemas.families import MODEL_HELP

if TYPE_CHECKING:
    from runtime.settings import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "worker",
        help="run a pipeline worker (" + ", ".join(KINDS) + ")",
        description="Run one pipeline stage until SIGTERM/SIGINT (then drain and commit). "
        + " ".join(f"{s.kind}: {s.help}." for s in STAGES.values()),
    )
    p.add_argument("kind", choices=KINDS)
    p.add_argument("--model", help=f"{MODEL_HELP} (default: EPD_MODEL)")
    p.add_argument("--store", help="embedding store URI (default: EPD_STORE_URL or EPD_REDIS_URL)")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (default: EPD_DEVICE)")
    p.add_argument(
        "--max-in-flight", type=int, help="concurrent events (default: EPD_MAX_IN_FLIGHT)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        # A string default goes through ``type`` too: a bad EPD_METRICS_PORT is argparse's
        # one-line error naming the flag, not a traceback while the parser is built.
        default=os.environ.get("EPD_METRICS_PORT") or "0",
        help="serve Prometheus metrics on this port (default: EPD_METRICS_PORT; 0: none)",
    )
    p.add_argument(
        "--metrics-host",
        default=os.environ.get("EPD_METRICS_HOST", "127.0.0.1"),
        help="address the metrics port listens on (default: EPD_METRICS_HOST or 127.0.0.1; "
        "0.0.0.0 in a container a Prometheus scrapes)",
    )
    p.add_argument("--log-level", default=os.environ.get("EPD_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--ready-file",
        type=Path,
        default=os.environ.get("EPD_READY_FILE") or None,
        help="touch this file once the worker holds partitions (for supervisors and the demo)",
    )
    p.add_argument(
        "--exit-with-parent",
        type=int,
        default=os.environ.get("EPD_EXIT_WITH_PARENT") or None,
        metavar="PID",
        help="stop (as on SIGTERM: drain and commit) once process PID is no longer this "
        "worker's parent: a supervisor that was killed leaves no worker behind",
    )
    p.add_argument(
        "--print-settings",
        action="store_true",
        help="print the settings this worker would run with as JSON (secrets as a SHA-256 "
        "digest) and exit",
    )
    p.set_defaults(func=run)


PARENT_CHECK_S = 1.0


def _exit_with_parent(parent: int) -> None:
    """SIGTERM to this process once ``parent`` is no longer its parent (it died: the process was
    handed to init), from a daemon thread that asks once a second."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="epd-parent-watch", daemon=True).start()


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``EPD_*`` settings with this command's flags on top."""
    from runtime.settings import Settings

    flags = {
        "model": args.model,
        "store_url": args.store,
        "device": args.device,
        "max_in_flight": args.max_in_flight,
    }
    return Settings(**{k: v for k, v in flags.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if args.print_settings:
        json.dump({"kind": args.kind, "settings": settings.describe()}, sys.stdout, sort_keys=True)
        sys.stdout.write("\n")
        return 0
    if STAGES[args.kind].uses_model:
        from runtime.model_spec import model_family  # no torch: the router needs none

        # Refuse an unsupported model family before joining any group (ModelLoadError: exit 2).
        model_family(settings.model)
    if STAGES[args.kind].computes:
        from runtime.torch_threads import apply_torch_threads, computes_on_cpu

        # Here, at the process's entry: the count is process-wide.
        apply_torch_threads(settings, model_on_cpu=computes_on_cpu(settings))
    from runtime import event_loop
    from runtime.logs import configure_logging

    configure_logging(args.log_level, settings.log_format)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
    if args.exit_with_parent is not None:
        _exit_with_parent(args.exit_with_parent)
    ready_file: Path | None = args.ready_file
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)

    async def ready() -> None:
        from runtime.heap import freeze_startup_heap

        # Started: the model, the clients and the loop live as long as the process.
        freeze_startup_heap()
        if ready_file is not None:
            await asyncio.to_thread(ready_file.write_text, f"{os.getpid()}\n")

    event_loop.run(run_worker(args.kind, settings, ready=ready), settings.event_loop)
    return 0
