"""The ``epd`` command line: one sub-command module per job under ``epd/commands``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pydantic import ValidationError as PydanticValidationError

from epd.local_pipeline import WorkerDied
from epd.stages import WorkerCannotStart
from runtime.errors import ModelLoadError

# Each module exposes ``register(subparsers)``, adding parsers whose default ``func(args) -> int``
# runs the command. Modules keep heavy imports (torch, transformers) inside their functions so
# ``epd --help`` stays fast.
COMMAND_MODULES = [
    "epd.commands.services",
    "epd.commands.topics",
    "epd.commands.validate",
    "epd.commands.vllm",
    "epd.commands.worker",
    "epd.commands.demo",
    "epd.commands.verify",
    "epd.commands.dlq",
    "epd.commands.api",
    "epd.commands.stack",
    "epd.commands.submit",
    "epd.commands.bench",
]


SETTINGS_MODELS = frozenset({"Settings", "LocalServices"})
"""Settings models whose validation errors are a user's setting, printed as one line."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(
        prog="epd",
        description="Kafka-native encode/prefill/decode coordinator for multimodal LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``epd`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from epd.commands.bench import run_bench

        return run_bench(argv[1:])  # python -m bench parses its own options (--help included)
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except WorkerDied as exc:
        # A worker that could not start (or died) under a command that runs the pipeline
        # (stack, demo, verify): its own last word, one line, not a traceback.
        print(f"epd: {exc.summary}", file=sys.stderr)
        return 1
    except WorkerCannotStart as exc:
        # epd worker: the broker or a store did not answer as it started.
        print(f"epd: {exc}", file=sys.stderr)
        return 1
    except ModelLoadError as exc:
        # A model that cannot be served (unsupported family, missing checkpoint) is the user's
        # input, not a crash: one line naming the problem, exit code 2.
        print(f"epd: {exc}", file=sys.stderr)
        return 2
    except PydanticValidationError as exc:
        # A bad EPD_* setting, found when the settings were built (before anything started).
        if exc.title not in SETTINGS_MODELS:
            raise
        from runtime.settings import settings_error

        print(f"epd: {settings_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
