"""Smoke test of ``python -m bench soak``: a ~15 s soak on the real pipeline and its summary.

Memory growth is NOT asserted (15 s on a shared machine says nothing about leaks; that is what
``make soak`` is for). What is checked: the summary has every field the soak promises, requests
completed (new, repeated and claim-checked images among them), each worker got an RSS and a
verdict, Redis and the broker were measured, no claim check outlived its request, and the run
left no keys behind. Services come from the ``settings`` fixture (real broker, real Redis).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.soak import KINDS, _growth, listener_pid, parse_args, rss_mb
from runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def soak_run(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], str]:
    """One short soak in a subprocess, started the way ``python -m bench soak`` is."""
    out = tmp_path_factory.mktemp("soak") / "summary.json"
    env = {**os.environ, "EPD_REDIS_URL": settings.redis_url}
    args = ["soak", "--seconds", "15", "--rps", "2", "--large-fraction", "0.5", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout)
    assert json.loads(out.read_text()) == summary
    return summary, done.stderr


def test_summary_fields_and_requests(soak_run: tuple[dict[str, Any], str]) -> None:
    summary, _ = soak_run
    req = summary["requests"]
    assert req["sent"] >= 20 and req["completed"] == req["sent"] and req["failed"] == 0
    assert req["repeated_images"] > 0 and req["claim_checked_images"] > 0
    assert 0 < req["p50_ms"] <= req["p99_ms"]
    names = [f"{kind}-{i}" for i, kind in enumerate(KINDS)] + ["driver"]
    assert list(summary["workers"]) == names
    for name, g in summary["workers"].items():
        assert g["start_mb"] > 10 and g["end_mb"] > 10, name
        assert {"growth_mb", "growth_pct"} <= set(g), name
        assert g["verdict"] in ("flat", "growing") and summary["verdicts"][name] == g["verdict"]
    assert summary["flat_threshold_pct"] > 0
    assert summary["growth_window_s"][0] >= summary["options"]["warmup_s"]
    assert summary["redis"]["used_memory_end_mb"] > 0
    assert "used_memory_growth_mb" in summary["redis"]


def test_per_interval_samples(soak_run: tuple[dict[str, Any], str]) -> None:
    summary, stderr = soak_run
    samples = summary["samples"]
    assert len(samples) >= 4  # t=0, intervals, final
    assert sum(s["requests"]["sent"] for s in samples) == summary["requests"]["sent"]
    assert sum(s["requests"]["completed"] for s in samples) == summary["requests"]["completed"]
    for s in samples:
        assert all(v is not None and v > 0 for v in s["rss_mb"].values()), s
        assert s["redis"]["used_memory_mb"] > 0
    assert any(s["requests"]["p99_ms"] for s in samples)
    lines = [ln for ln in stderr.splitlines() if ln.startswith("soak t=")]
    assert len(lines) == len(samples)
    assert all("rss_mb[" in ln and "p99_ms=" in ln and "redis_mb=" in ln for ln in lines)


def test_broker_measured(soak_run: tuple[dict[str, Any], str]) -> None:
    broker = soak_run[0]["broker"]
    if broker["pid"] is None:
        pytest.skip("the broker is not a process on this machine (remote or another user's)")
    assert broker["start_mb"] > 0 and broker["end_mb"] > 0


def test_claim_checks_deleted_and_no_keys_left(
    soak_run: tuple[dict[str, Any], str], settings: Settings
) -> None:
    import redis

    from bench.soak import REDIS_DB
    from tests.conftest import redis_url_with_db

    summary, _ = soak_run
    # Every request has finished by the last sample: the encoder deleted every claim check.
    assert summary["redis"]["keys_end"]["claim"] == 0
    assert summary["redis"]["keys_end"]["store"] > 0  # embeddings were there to count
    client = redis.Redis.from_url(redis_url_with_db(settings.redis_url, REDIS_DB))
    try:
        prefix = summary["redis_key_prefix"]
        assert list(client.scan_iter(match=f"{prefix}*", count=1000)) == []
    finally:
        client.close()


# --- pure helpers ---------------------------------------------------------------------------


def test_rss_of_this_process_and_of_nothing() -> None:
    mine = rss_mb(os.getpid())
    assert mine is not None and mine > 10
    assert rss_mb(None) is None
    assert rss_mb(2**22 + 12345) is None  # above the default pid_max: no such process


def test_listener_pid_finds_our_socket() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert listener_pid(port) is None  # bound, not listening
        s.listen()
        assert listener_pid(port) == os.getpid()


def test_growth_verdicts() -> None:
    assert _growth(100.0, 104.0, 5.0)["verdict"] == "flat"
    grown = _growth(100.0, 106.0, 5.0)
    assert grown["verdict"] == "growing" and grown["growth_mb"] == 6.0
    assert grown["growth_pct"] == 6.0
    assert _growth(None, 100.0, 5.0) == {"verdict": "unknown"}


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        (["--minutes", "0"], "must be positive"),
        (["--rps", "-1"], "must be positive"),
        (["--repeat-fraction", "1.5"], "--repeat-fraction must be between 0 and 1"),
        (["--interval-s", "0"], "--interval-s must be positive"),
        (["--warmup-s", "-1"], "--warmup-s must not be negative"),
    ],
)
def test_bad_options_are_refused(
    argv: list[str], rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    assert rule in capsys.readouterr().err


def test_seconds_overrides_minutes() -> None:
    assert parse_args(["--minutes", "3"]).duration_s == 180
    assert parse_args(["--minutes", "3", "--seconds", "20"]).duration_s == 20
