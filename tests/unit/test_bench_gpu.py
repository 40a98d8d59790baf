"""Smoke test of ``bench/gpu.py``: its CPU dry run (tiny sizes, fp32) runs every section and
reports each one, and without CUDA the plain run says it skipped. Numbers are not judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("parity", "encode", "stores", "overhead")


def _run(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "bench/gpu.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_says_skipped(tmp_path: Path) -> None:
    done = _run(out=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"skipped": "no CUDA", "meets_budget": None}


def test_cpu_dry_run_reports_every_section(tmp_path: Path) -> None:
    done = _run("--cpu-dry-run", "--quick", out=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert json.loads((tmp_path / "gpu.json").read_text()) == doc  # $OUT/gpu.json, complete
    progress = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [p["section"] for p in progress] == list(SECTIONS)  # printed as each one finished
    for name in SECTIONS:
        assert "error" not in doc[name], f"{name}: {doc[name]}"
    tiny = doc["parity"]["tiny"]
    assert len(tiny["generate_tokens"]) == tiny["steps"] == 16
    assert tiny["batched_matches_generate"] and tiny["separate_matches_generate"], tiny
    assert doc["parity"]["all_match"] is True
    for side in ("56px", "112px"):
        assert doc["encode"][side]["batched_images_per_s"] > 0
    stores = doc["stores"]
    assert stores["cuda_same_process"]["get_p50_ms"] > 0 and stores["shm"]["put_p50_ms"] > 0
    assert "redis" in stores  # measured, or the reason it was skipped
    assert doc["overhead"]["gpu_ms"]["total"] > 0
    assert 0 < doc["overhead"]["with_cuda_store"]["share_of_gpu_compute"]
