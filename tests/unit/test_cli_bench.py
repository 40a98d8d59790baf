"""``epd bench``: the benchmarks as a CLI command, with the same JSON as ``python -m bench``.

Run from a directory outside the checkout, so ``bench`` must be importable as an installed
package (``pyproject.toml`` packages it), not merely from the repository root. Only the two
benchmarks that need no services run (``prefill_bytes``, ``codec``, ``--quick``); numbers are
not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from epd.cli import build_parser


def _epd() -> list[str]:
    script = Path(sys.executable).with_name("epd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "epd.cli"]


def test_epd_bench_writes_the_same_json_as_python_m_bench(tmp_path: Path) -> None:
    out, doc = tmp_path / "out", tmp_path / "run" / "bench.json"
    done = subprocess.run(
        [
            *_epd(),
            "bench",
            "prefill_bytes",
            "codec",
            "--quick",
            "--out",
            str(out),
            "--json",
            str(doc),
        ],
        cwd=tmp_path,
        env={**os.environ, "MPLBACKEND": "Agg"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["options"] == {
        "quick": True,
        "benchmarks": ["prefill_bytes", "codec"],
        "broker_jvm_profile": os.environ.get("EPD_KAFKA_JVM_PROFILE", "production"),
    }
    assert json.loads(doc.read_text()) == report == json.loads((out / "results.json").read_text())
    for name in ("prefill_bytes", "codec"):
        assert isinstance(report[name]["meets_budget"], bool)
    assert report["summary"]["errors"] == []


def test_epd_bench_refuses_an_unknown_name_like_python_m_bench() -> None:
    done = subprocess.run(
        [*_epd(), "bench", "codec", "nosuch"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "nosuch" in done.stderr and "choose from" in done.stderr


def test_epd_bench_passes_every_argument_through() -> None:
    args = build_parser().parse_args(["bench", "codec", "--quick", "--json", "x.json"])
    assert args.bench_args == ["codec", "--quick", "--json", "x.json"]
    # --help is python -m bench's own (the options and the benchmark names)
    done = subprocess.run([*_epd(), "bench", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--quick" in done.stdout and "prefill_bytes" in done.stdout
