"""``epd bench [NAME ...] [--quick] [--json FILE]``: the side-by-side benchmarks of ``bench/``.

The same command, options and JSON document as ``python -m bench`` (both come from
``bench/__main__.py``); the soak stays ``python -m bench soak`` / ``make soak``.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from bench.__main__ import BENCHMARKS, add_arguments

    p = sub.add_parser(
        "bench",
        help="run the benchmarks against DESIGN.md's budgets and print one JSON document",
        description=(
            "Side-by-side benchmarks against DESIGN.md's budgets "
            f"({', '.join(BENCHMARKS)}); stdout is one JSON document, progress goes to stderr."
        ),
    )
    add_arguments(p)
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    """Exit 0 when every selected benchmark ran, 1 when one raised (or, with ``--check``,
    missed its budget), 2 for an unknown benchmark name."""
    from bench.__main__ import BENCHMARKS, run_selected, unknown_names

    unknown = unknown_names(args.names)
    if unknown:
        args._parser.error(
            f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}"
        )
    return run_selected(args)
