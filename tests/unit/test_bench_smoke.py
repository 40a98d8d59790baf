"""Smoke test of ``python -m bench --quick``: every benchmark runs and reports well-formed JSON.

Budgets are NOT asserted (the machine is shared; timing belongs in ``make bench``). What is
checked: each benchmark produced its block without an error, each block quotes its budget and a
boolean verdict, every number it measured is positive, and the results land under ``--out``.
Redis comes from the ``settings`` fixture (a real server); the benchmarks use DB 11 under a
unique key prefix and delete their keys.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import BENCHMARKS, FIGURES_ONLY, OPT_IN, parse_args
from bench.common import Stats, headroom, quantile
from bench.plot import headroom_rows, headroom_svg
from runtime.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
# Numbers that may legitimately be zero (counts of things that did not happen).
ZERO_OK = frozenset({"ours_encode_events", "waiting_pct", "event_loop_c_pct", "server_usec"})
CPU_SHARES = frozenset(
    {
        "worker_cpu",
        "worker_idle_cpu_pct",
        "idle_cpu_pct",
        "cpu_ms_per_request",
        "idle_cpu_pct_no_clients",
        "idle_cpu_pct_with_pipeline_consumers",
        # a process's waits per request: one with nothing to do in a cell (the router; the
        # encode worker while the image is cached) waits for none
        "context_switches_per_request",
        # the bare operations' CPU: a quick run's few Redis round trips can cost the server
        # less than one 10 ms clock tick (test_coordinator_block checks how they compare)
        "bare_cpu",
    }
)
DEFAULT = [n for n in BENCHMARKS if n not in OPT_IN]  # what a run without names selects


PIPELINE_BROKERS = "tansu"
"""The broker the smoke's ``pipeline`` and ``coordinator`` blocks run on (``EPD_BENCH_BROKERS``):
one, not both as in ``make bench``, so their worker processes start once; the code is the same on
either broker, and the ``brokers`` block still starts both. Tansu: the one that starts in a
second."""


@pytest.fixture(scope="module")
def quick_run(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, Any], Path]]:
    """One ``python -m bench --quick`` run in a subprocess, as ``make bench`` would start it."""
    from bench.pipeline import BROKERS_ENV

    out = tmp_path_factory.mktemp("bench-out")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BROKERS_ENV, PIPELINE_BROKERS)  # here too: test_pipeline_block reads it
        env = {**os.environ, "EPD_REDIS_URL": settings.redis_url}
        done = subprocess.run(
            [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        yield json.loads(done.stdout), out


def _numbers(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every numeric leaf (bools excluded) with its dotted path."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}[{i}]")


@pytest.mark.slow
def test_every_benchmark_reports_its_budget(quick_run: tuple[dict[str, Any], Path]) -> None:
    report, _ = quick_run
    # The brokers the benchmarks start run the production JVM unless EPD_KAFKA_JVM_PROFILE says.
    assert report["options"] == {
        "quick": True,
        "benchmarks": DEFAULT,
        "broker_jvm_profile": os.environ.get("EPD_KAFKA_JVM_PROFILE", "production"),
    }
    for name in DEFAULT:
        block = report[name]
        assert "error" not in block, f"{name}: {block.get('error')}"
        if name in FIGURES_ONLY:
            assert "meets_budget" not in block, f"{name} has no budget to meet"
            continue
        assert isinstance(block["meets_budget"], bool), name
        assert isinstance(block["budget"]["design"], str) and block["budget"]["design"], name
        assert len(block["budget"]) >= 2, f"{name}: the budget has no numeric threshold"
        assert block["headroom"], f"{name}: no headroom reported"
    summary = report["summary"]
    assert summary["errors"] == []
    assert set(summary["meets_budget"]) == set(DEFAULT) - FIGURES_ONLY
    assert summary["all_meet_budget"] == all(summary["meets_budget"].values())


@pytest.mark.slow
def test_measured_numbers_are_positive(quick_run: tuple[dict[str, Any], Path]) -> None:
    report, _ = quick_run
    for name in DEFAULT:
        numbers = list(_numbers(report[name]))
        assert len(numbers) > 5, f"{name} measured almost nothing"
        for path, value in numbers:
            assert math.isfinite(value), f"{name}.{path} = {value}"
            # CPU shares can round to 0 in a short quick run (the clock ticks in 10 ms)
            parts = set(path.split("."))
            parts |= {p.split("[")[0] for p in parts}
            if path.rsplit(".", 1)[-1] in ZERO_OK or parts & CPU_SHARES:
                assert value >= 0, f"{name}.{path} = {value}"
            else:
                assert value > 0, f"{name}.{path} = {value}"


@pytest.mark.slow
def test_benchmark_specific_shape(quick_run: tuple[dict[str, Any], Path]) -> None:
    report, _ = quick_run
    pb = report["prefill_bytes"]
    assert pb["image"]["grid_thw"] == [1, 74, 74]
    # The metadata-only event is far smaller than either full-kwargs baseline.
    ours = pb["qwen2vl_ids"]["ours_prefill_event_bytes"]
    assert ours < pb["qwen2vl_ids"]["fp32"]["avro_full_kwargs_bytes"] // 100
    codec = report["codec"]
    for dtype in ("fp32", "bf16"):
        assert codec[dtype]["avro"]["roundtrip"]["n"] >= 1
        assert codec[dtype]["vllm_body_bytes"] > codec[dtype]["avro_frame_bytes"]
    stores = report["stores"]
    assert "1MiB" in stores["redis"] and "4MiB" in stores["shm"]
    # the third column: redis-py with hiredis, beside our wire path
    assert stores["redis_py_uses_hiredis"] is True
    assert set(stores["redis"]["1MiB"]["speedup_vs_redis_py_hiredis"]) == {"put", "get"}
    assert stores["redis"]["1MiB"]["redis_py_hiredis_get"]["mb_s"] > 0
    if stores["redis_benchmark_available"]:
        assert stores["redis"]["1MiB"]["redis_benchmark"]["get_mb_s"] > 0
    cache = report["encoder_cache"]
    assert cache["redis"]["plan"]["p50_ms"] > 0


@pytest.mark.slow
def test_machine_facts_and_outputs(quick_run: tuple[dict[str, Any], Path]) -> None:
    report, out = quick_run
    machine = report["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["python"].startswith("3.")
    assert machine["torch"]
    assert json.loads((out / "results.json").read_text()) == report
    svg = ET.fromstring((out / "headroom.svg").read_text())
    assert svg.tag.endswith("svg")


@pytest.mark.slow
def test_no_keys_left_in_redis(quick_run: tuple[dict[str, Any], Path], settings: Settings) -> None:
    import redis

    report, _ = quick_run
    from bench.stores import BENCHMARK_KEY, REDIS_DB
    from tests.conftest import redis_url_with_db

    client = redis.Redis.from_url(redis_url_with_db(settings.redis_url, REDIS_DB))
    try:
        for name in ("stores", "encoder_cache"):
            prefix = report[name]["redis_key_prefix"]
            assert prefix.startswith("bench-")
            leftovers = list(client.scan_iter(match=f"{prefix}*", count=1000))
            assert leftovers == [], f"{name} left {leftovers}"
        assert not client.exists(BENCHMARK_KEY)
    finally:
        client.close()


@pytest.mark.slow
def test_pipeline_block(quick_run: tuple[dict[str, Any], Path], settings: Settings) -> None:
    import redis

    from bench.pipeline import HOP_PARTS, QUICK, REDIS_DB, bench_brokers
    from tests.conftest import redis_url_with_db

    block = quick_run[0]["pipeline"]
    wanted, skipped = bench_brokers()
    assert set(block["brokers"]) == set(wanted) and block["skipped_brokers"] == skipped
    assert block["judged_on"] == ("apache" if "apache" in wanted else wanted[0])
    for name, per in block["brokers"].items():
        miss, hit = per["overhead"]["miss"], per["overhead"]["hit"]
        assert miss["end_to_end_ms"]["n"] == QUICK.misses, name
        assert hit["end_to_end_ms"]["n"] == QUICK.hits, name
        # The encoder ran for every miss and for no hit; compute is subtracted from end to end.
        assert miss["vision_tower_ms"]["n"] == QUICK.misses and "vision_tower_ms" not in hit
        assert miss["model_compute_ms"]["mean_ms"] < miss["end_to_end_ms"]["mean_ms"]
        hop = per["kafka_hop"]["worker_consumer_settings"]
        assert set(HOP_PARTS) <= set(hop) and hop["total"]["n"] == QUICK.hops
        # the parts of a hop add up to it (each sample's parts sum to its total exactly)
        parts = sum(hop[p]["mean_ms"] for p in HOP_PARTS if p != "total")
        assert parts == pytest.approx(hop["total"]["mean_ms"], rel=0.01)
    judged = block["brokers"][block["judged_on"]]
    assert block["overhead_p50_ms"] == judged["overhead"]["miss"]["overhead_ms"]["p50_ms"]
    assert block["overhead_hit_p50_ms"] == judged["overhead"]["hit"]["overhead_ms"]["p50_ms"]
    tp = block["throughput"]
    assert tp["event_bytes"]["ours"] * 100 < tp["event_bytes"]["full_kwargs"]
    assert set(tp["requests_per_s"]) == {
        "ours",
        "full_kwargs_same_compression",
        "full_kwargs_uncompressed",
    }
    client = redis.Redis.from_url(redis_url_with_db(settings.redis_url, REDIS_DB))
    try:
        for prefix in block["redis_key_prefixes"].values():
            assert list(client.scan_iter(match=f"{prefix}*", count=1000)) == []
    finally:
        client.close()


# --- pure helpers ---------------------------------------------------------------------------


def test_unknown_benchmark_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["codec", "nosuch"])
    assert exc.value.code == 2
    assert "nosuch" in capsys.readouterr().err


def test_quantiles_and_headroom() -> None:
    s = Stats([4.0, 1.0, 3.0, 2.0, 5.0])
    assert s.p50 == 3.0
    assert quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == pytest.approx(4.6)
    assert headroom(20.0, 5.0, higher_is_better=True) == 4.0
    assert headroom(4.0, 2.0, higher_is_better=False) == 0.5


def test_svg_has_one_bar_per_headroom() -> None:
    report = {"a": {"headroom": {"x": 2.0, "y": 0.5}}, "b": {"headroom": {"z": 10.0}}}
    assert headroom_rows(report) == [("a.x", 2.0), ("a.y", 0.5), ("b.z", 10.0)]
    svg = ET.fromstring(headroom_svg(report))
    rects = [e for e in svg.iter() if e.tag.endswith("rect")]
    assert len(rects) == 3


@pytest.mark.slow
def test_throughput_block(quick_run: tuple[dict[str, Any], Path]) -> None:
    from bench.throughput import QUICK

    report, out = quick_run
    block = report["throughput"]
    cells = block["cells"]
    assert [(c["encode_workers"], c["side"]) for c in cells] == [
        (w, side) for w in (1, 2) for side in QUICK.sides
    ]
    for c in cells:
        assert c["requests"] == QUICK.requests
        assert c["latency_ms"]["p99"] >= c["latency_ms"]["p50"] > 0
        assert c["busiest"] in c["busy_s"]
        assert sum(name.startswith("encode#") for name in c["worker_cpu"]) == c["encode_workers"]
    assert set(block["scale_out_2_vs_1"]) == {str(side) for side in QUICK.sides}
    assert block["partitions"] == 4
    # the PNG charts of the three benchmarks they draw on (matplotlib is a test dependency)
    for name in ("overhead_parts.png", "throughput.png", "prefill_bytes.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


@pytest.mark.slow
def test_brokers_block(quick_run: tuple[dict[str, Any], Path]) -> None:
    from epd.services import kafka

    block = quick_run[0]["brokers"]
    expected = {"tansu"} | ({"apache"} if kafka.unavailable_reason() is None else set())
    assert set(block["brokers"]) == expected
    for name, broker in block["brokers"].items():
        assert broker["start_s"]["n"] >= 1 and broker["start_s"]["p50_s"] > 0, name
        assert broker["idle_rss_mb"] > 1, name
        assert broker["idle_cpu_pct_with_pipeline_consumers"]["consumers"] == 4, name
    if "apache" in block["brokers"]:
        assert block["brokers"]["apache"]["version"] == "Apache Kafka 4.4.0"
        assert block["brokers"]["apache"]["idle_fetch_max_wait_ms"] == 5000
        assert block["brokers"]["apache"]["jvm_profile"] == "production"
    assert block["brokers"]["tansu"]["idle_fetch_max_wait_ms"] == 250


@pytest.mark.slow
def test_coordinator_block(quick_run: tuple[dict[str, Any], Path]) -> None:
    from bench.coordinator import CASES, CONCURRENCY, QUICK
    from bench.pipeline import bench_brokers

    block = quick_run[0]["coordinator"]
    wanted, skipped = bench_brokers()
    assert set(block["brokers"]) == set(wanted) and block["skipped_brokers"] == skipped
    for name, per in block["brokers"].items():
        for case in CASES:
            for concurrency in CONCURRENCY:
                cell = per["cells"][case][f"c{concurrency}"]
                assert cell["requests"] == QUICK.requests, name
                assert {"api", "encode", "prefill", "results", "router"} <= set(
                    cell["cpu_ms_per_request"]
                )
                # one prefill event per request; the encode stage only for new images
                assert cell["kafka_records_per_request"]["by_topic"]["prefill"] > 0
                has_encode = "encode" in cell["kafka_records_per_request"]["by_topic"]
                assert has_encode == (case == "new"), (name, case, concurrency)
                assert cell["redis_commands_per_request"]["top"]
                assert cell["context_switches_per_request"]["api"] > 0  # it answered over HTTP
        floor = per["floor"]
        assert floor["floor_ms"]["new"] > floor["floor_ms"]["cached"] >= floor["kafka_hop_p50_ms"]
        # Four significant digits (bench.common.sig): a loaded host's 137.72 ms is 137.7.
        assert per["overhead_vs_floor_ms"]["new"] == pytest.approx(
            per["cells"]["new"]["c1"]["latency_ms"]["p50"] - floor["floor_ms"]["new"],
            rel=1e-3,
            abs=0.01,
        )
        bare = floor["bare_cpu"]
        # /proc counts the broker's CPU in 10 ms ticks: the records one at a time take tens of
        # them, the 16 in flight a few (the client's own CPU is read exactly).
        one, batched = bare["kafka_hop_one_at_a_time"], bare["kafka_hop_16_in_flight"]
        assert one["client_ms"] > 0 and one["broker_ms"] > 0, (name, bare)
        assert batched["client_ms"] > 0 and batched["total_ms"] < one["total_ms"], (name, bare)
        assert bare["redis_round_trip"]["client_ms"] > 0
        hop = bare["thread_hop_round_trip"]
        assert hop["thread_lane_cpu_us"] > 0 and hop["run_in_executor_cpu_us"] > 0, hop
        assert set(per["profile"]) == {f"{case}_c{max(CONCURRENCY)}" for case in CASES}
        assert per["rss_mb"]["results"] > 0 and "total" in per["idle_cpu_pct"]
        assert "total" in per["idle_cpu_pct"]["just_after_traffic"]  # the tail, apart
    assert "tiny_model" not in block["brokers"][block["judged_on"]]  # not with --quick
