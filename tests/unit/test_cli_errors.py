"""A pipeline command whose model is unknown, or whose worker cannot start, says why in one
line (no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd.local_pipeline import WorkerDied, WorkerProcesses
from runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def epd(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m epd ARGS`` from the repository root with ``env`` (and the repository on the
    path), its output as text."""
    return subprocess.run(
        [sys.executable, "-m", "epd", *args],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


@pytest.mark.parametrize("command", [["stack", "--port", "0"], ["worker", "prefill"], ["verify"]])
def test_an_unknown_model_is_one_line_before_anything_starts(command: list[str]) -> None:
    out = epd(*command, env={"PATH": "/usr/bin:/bin", "EPD_MODEL": "no-such-model"})
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert lines == [lines[0]] and "no-such-model" in lines[0], out.stderr
    assert "Traceback" not in out.stderr and "started" not in out.stdout


def test_verify_refuses_the_instant_engine_in_one_line() -> None:
    out = epd("verify", env={"PATH": "/usr/bin:/bin", "EPD_MODEL": "instant"})
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines() == [
        "epd: instant runs no model, so there is nothing to verify; give a tiny spec or a "
        "checkpoint"
    ]


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"EPD_EVENT_LOOP": "trio"}, "EPD_EVENT_LOOP"),
        ({"EPD_RENDER_CACHE_BYTES": "-1"}, "EPD_RENDER_CACHE_BYTES"),
        ({"EPD_READY_STAGES": "encode,gpu"}, "EPD_READY_STAGES"),
        ({"EPD_ADMIN_TOKENS": "no-name-here"}, "EPD_ADMIN_TOKENS"),
    ],
)
def test_a_bad_new_setting_is_one_line_naming_it(env: dict[str, str], named: str) -> None:
    out = epd("worker", "results", "--print-settings", env={"PATH": "/usr/bin:/bin", **env})
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("kind", ["results", "encode"])
def test_a_worker_whose_broker_does_not_answer_says_so_in_one_line(kind: str) -> None:
    """No broker where EPD_KAFKA_BOOTSTRAP points: the worker exits 1 with one line naming
    the broker and the setting, not a traceback."""
    out = epd(
        "worker",
        kind,
        env={
            "PATH": "/usr/bin:/bin",
            "EPD_KAFKA_BOOTSTRAP": "127.0.0.1:1",
            "EPD_ALLOW_UNSIGNED": "true",
            "EPD_MODEL": "instant",
        },
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"epd: the {kind} worker cannot start: the broker at 127.0.0.1:1 ")
    assert "EPD_KAFKA_BOOTSTRAP" in last, last


def test_a_worker_whose_redis_does_not_answer_says_so_in_one_line(topic_settings: Settings) -> None:
    """The broker is up, Redis is not: the worker exits 1 with one line naming Redis and
    EPD_REDIS_URL (it cannot load its status script), not a traceback."""
    env = {
        **os.environ,
        **topic_settings.to_env(),
        "EPD_REDIS_URL": "redis://127.0.0.1:1/0",
    }
    out = epd("worker", "results", env=env, timeout=180)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("epd: the results worker cannot start: Redis (EPD_REDIS_URL)"), last


async def test_a_worker_that_cannot_start_is_named_with_its_own_words(tmp_path: Path) -> None:
    workers = WorkerProcesses({"EPD_MODEL": "no-such-model"}, tmp_path, ["encode"])
    workers.start()
    try:
        with pytest.raises(WorkerDied) as died:
            await workers.wait_ready(timeout_s=120)
    finally:
        workers.stop()
    summary = died.value.summary
    assert summary.startswith("the encode worker exited with 2: model 'no-such-model'")
    assert "\n" not in summary and str(tmp_path) in summary


def test_a_bad_metrics_port_is_argparses_error_naming_the_flag() -> None:
    out = epd(
        "worker",
        "results",
        "--print-settings",
        env={"PATH": "/usr/bin:/bin", "EPD_METRICS_PORT": "abc"},
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last == "epd worker: error: argument --metrics-port: invalid int value: 'abc'"
