"""Smoke test of ``python -m bench api-soak``: a short run on the real stack and its summary.

Memory growth is NOT asserted here (a minute on a shared machine says nothing about leaks;
the 1,200-request run in the README's Performance notes is the measurement). What is checked:
every kind of request was sent and answered as it should be (refusals 4xx, never 5xx), both
processes got RSS samples and a verdict, and nothing errored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.settings import Settings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_api_soak_summary(settings: Settings, tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    args = ["api-soak", "--requests", "80", "--sample-every", "40", "--warmup", "40"]
    done = subprocess.run(
        [sys.executable, "-m", "bench", *args, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "EPD_REDIS_URL": settings.redis_url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert json.loads(out.read_text()) == summary
    answers = summary["requests"]["answers"]
    assert summary["requests"]["sent"] == 80 and not summary["requests"]["errors"]
    assert not [k for k in answers if k.endswith((":500", ":502", ":503"))], answers
    assert any(k.startswith("image:completed") for k in answers), answers
    assert {k.split(":")[1] for k in answers if k.startswith("refused:")} <= {"400", "413", "422"}
    assert set(summary["verdicts"]) == {"api", "results-collector"}
    assert [s["requests"] for s in summary["samples"]] == [0, 40, 80]
    for g in summary["processes"].values():
        assert g["start_mb"] > 50 and "growth_pct" in g
