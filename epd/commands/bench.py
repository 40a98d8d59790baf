"""``epd bench [NAME ...] [--quick] [--json FILE]``: the side-by-side benchmarks of ``bench/``.

The very same command as ``python -m bench`` (options, JSON document, exit status): ``epd`` runs
it in a child interpreter with the arguments as given. ``bench`` sits above ``epd`` (its
pipeline benchmarks start local pipelines), so ``epd`` never imports it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmarks against docs/design.md's budgets and print one JSON document",
        description=(
            "Side-by-side benchmarks against docs/design.md's budgets: the same options and JSON "
            "as `python -m bench` (`epd bench --help` shows them, and the benchmark names)."
        ),
        add_help=False,
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="python -m bench's arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``python -m bench`` with the given arguments (see :func:`run_bench`)."""
    return run_bench(args.bench_args)


def run_bench(argv: list[str]) -> int:
    """``python -m bench ARGV``: 0 when every selected benchmark ran, 1 when one raised (or,
    with ``--check``, missed its budget), 2 for an unknown name or option. ``epd``'s own parser
    never sees these arguments (``epd.cli.main`` hands them over as they are)."""
    return subprocess.call([sys.executable, "-m", "bench", *argv])
