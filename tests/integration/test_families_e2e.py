"""Qwen3-VL end to end through the real CLI: ``epd demo`` as a process (workers as ``epd worker``
processes, a real broker, a real Redis) on the tiny model.

Per-family parity through the real workers is in tests/unit/test_families.py (in-process, over
Redis); ``epd verify --model tiny-qwen2.5-vl|tiny-qwen3-vl`` runs the same check through Kafka.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.settings import Settings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def epd(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,  # the settings fixture exported the test broker and Redis
        "PYTHONPATH": str(REPO),
        "EPD_STATE_DIR": str(tmp_path / "state"),
    }
    return subprocess.run(
        [sys.executable, "-m", "epd.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=540,
        check=False,
    )


def test_demo_runs_on_tiny_qwen3_vl(settings: Settings, tmp_path: Path) -> None:
    proc = epd(tmp_path, "demo", "--model", "tiny-qwen3-vl", "--json", "--max-tokens", "6")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["completed"] == summary["requests"] > 0, summary["not_completed"]
    assert summary["not_completed"] == []
    assert summary["encoder_cache_hits"] >= 1  # the repeated image's entry (with deepstack)
