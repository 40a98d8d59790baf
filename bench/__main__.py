"""``python -m bench [NAME ...] [--quick] [--out DIR] [--json FILE] [--check]``: run benchmarks,
print JSON. ``epd bench`` is the same command (``epd/commands/bench.py`` reuses
:func:`add_arguments` and :func:`run_selected`).

``python -m bench soak [OPTIONS]`` runs the soak instead (``bench/soak.py``; not a budgeted
benchmark, so it is never part of the default selection), ``python -m bench api-soak`` the
HTTP API's soak (``bench/api_soak.py``), ``python -m bench api-bodies`` the API under many
big bodies at once (``bench/api_bodies.py``), ``python -m bench api-decode-bombs`` the API under
images that are slow to decode (``bench/api_decode_bombs.py``).

stdout gets one JSON document: ``machine`` facts, the run ``options``, one key per benchmark
(its numbers, its ``budget`` from docs/design.md and ``meets_budget``) and a ``summary``. Progress
goes to stderr. The same document is written to ``DIR/results.json`` with a headroom chart
``DIR/headroom.svg`` and, where matplotlib is installed, the PNG charts of ``bench/plot.py``
(default DIR: ``bench/out``, which git ignores); ``--json FILE`` writes it to FILE as well.

Exit status: 0 when every selected benchmark ran (budgets missed or not; ``--check`` makes a
missed budget exit 1 too), 1 when one raised.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import machine_facts, production_broker, sig

BENCHMARKS: dict[str, str] = {
    "brokers": "bench.brokers",
    "prefill_bytes": "bench.prefill_bytes",
    "codec": "bench.codec",
    "stores": "bench.stores",
    "encoder_cache": "bench.encoder_cache",
    "pipeline": "bench.pipeline",
    "throughput": "bench.throughput",
    "decode": "bench.decode_batching",
    "openai": "bench.openai_stream",
    "coordinator": "bench.coordinator",
    "gpu": "bench.gpu",
}
"""Benchmark name -> module exposing ``run(*, quick, out, ...) -> dict``, in run order."""
FIGURES_ONLY = frozenset({"brokers", "openai"})
"""Benchmarks that report figures without a docs/design.md budget (no ``meets_budget``)."""
OPT_IN = frozenset({"gpu"})
"""Run only when named: ``gpu`` needs CUDA (without it, it reports ``skipped: no CUDA``)."""
NEEDS_REDIS = frozenset(
    {"stores", "encoder_cache", "pipeline", "throughput", "decode", "openai", "coordinator"}
)
OPTIONS: dict[str, tuple[str, ...]] = {"coordinator": ("code_dir", "requests")}
"""Options only some benchmarks take (passed to their ``run`` when given)."""
DEFAULT_OUT = Path(__file__).parent / "out"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark options, shared by ``python -m bench`` and ``epd bench``."""
    p.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run (default: all but {', '.join(sorted(OPT_IN))}): "
        f"{', '.join(BENCHMARKS)}",
    )
    p.add_argument("--quick", action="store_true", help="few repeats: a smoke run, not a result")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for results and charts")
    p.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the JSON document to FILE",
    )
    p.add_argument(
        "--redis-url",
        default=None,
        help="Redis to benchmark against (default: EPD_REDIS_URL; DB 11 is used)",
    )
    p.add_argument("--check", action="store_true", help="exit 1 when a budget is missed")
    p.add_argument(
        "--code-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="coordinator: run the stack's processes (API, workers) from the checkout in DIR "
        "(default: EPD_BENCH_CODE_DIR, else this one), to measure a before and an after",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="coordinator: requests per cell (default 96; 8 with --quick)",
    )


def unknown_names(names: Sequence[str]) -> list[str]:
    """The requested benchmark names that do not exist."""
    return [n for n in names if n not in BENCHMARKS]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Side-by-side benchmarks of epd-pipeline against its docs/design.md budgets.",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    unknown = unknown_names(args.names)
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    return args


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one benchmark; an exception becomes an ``error`` entry rather than ending the run."""
    module = importlib.import_module(BENCHMARKS[name])
    kwargs: dict[str, Any] = {"quick": args.quick, "out": args.out}
    if name in NEEDS_REDIS and args.redis_url:
        kwargs["redis_url"] = args.redis_url
    for option in OPTIONS.get(name, ()):
        if getattr(args, option, None) is not None:
            kwargs[option] = getattr(args, option)
    t0 = time.perf_counter()
    try:
        result = dict(module.run(**kwargs))
    except Exception as exc:  # report and go on: one broken service must not hide the rest
        traceback.print_exc(file=sys.stderr)
        result = {"error": f"{type(exc).__name__}: {exc}", "meets_budget": None}
    result["wall_s"] = sig(time.perf_counter() - t0)
    return result


def run_selected(args: argparse.Namespace) -> int:
    """Run the benchmarks ``args`` selects, print and write the JSON document; the exit status."""
    names = args.names or [n for n in BENCHMARKS if n not in OPT_IN]
    report: dict[str, Any] = {
        "machine": machine_facts(),
        "options": {
            "quick": args.quick,
            "benchmarks": names,
            "broker_jvm_profile": production_broker(),
        },
    }
    t0 = time.perf_counter()
    for name in names:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        report[name] = run_one(name, args)
        print(
            f"bench: {name}: meets_budget={report[name].get('meets_budget')} "
            f"({report[name]['wall_s']} s)",
            file=sys.stderr,
            flush=True,
        )
    # A benchmark without a budget (figures only, e.g. ``brokers``) has no verdict.
    verdicts = {n: report[n].get("meets_budget") for n in names if "meets_budget" in report[n]}
    errors = [n for n in names if "error" in report[n]]
    report["summary"] = {
        "meets_budget": verdicts,
        "all_meet_budget": all(v is True for v in verdicts.values()),
        "errors": errors,
        "wall_s": sig(time.perf_counter() - t0),
    }
    text = json.dumps(report, indent=2, allow_nan=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(text + "\n")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    from bench.plot import headroom_svg, write_pngs

    (args.out / "headroom.svg").write_text(headroom_svg(report))
    written = write_pngs(report, args.out)
    if written:
        print(f"bench: charts: {', '.join(str(p) for p in written)}", file=sys.stderr)
    print(text)
    if errors:
        return 1
    if args.check and not report["summary"]["all_meet_budget"]:
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    production_broker()
    if argv[:1] == ["soak"]:
        from bench.soak import main as soak_main

        return soak_main(argv[1:])
    if argv[:1] == ["api-soak"]:
        from bench.api_soak import main as api_soak_main

        return api_soak_main(argv[1:])
    if argv[:1] == ["api-bodies"]:
        from bench.api_bodies import main as api_bodies_main

        return api_bodies_main(argv[1:])
    if argv[:1] == ["api-decode-bombs"]:
        from bench.api_decode_bombs import main as api_decode_bombs_main

        return api_decode_bombs_main(argv[1:])
    return run_selected(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
