"""``bench/coordinator.py``'s pure parts: the per-request counts, the floor, the verdict, the
profile's summary, and the options that reach it. The benchmark itself runs in
``test_bench_smoke.py`` (``--quick``, one broker); no numbers are asserted anywhere."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from bench import coordinator as c
from bench.__main__ import OPTIONS, parse_args
from bench.worker_profile import summarize


def test_commandstats_delta_counts_per_request_and_leaves_info_out() -> None:
    before = {"cmdstat_get": {"calls": 10, "usec": 100}, "cmdstat_info": {"calls": 3, "usec": 9}}
    after = {
        "cmdstat_get": {"calls": 30, "usec": 300},
        "cmdstat_set": {"calls": 4, "usec": 40},  # new since the first reading
        "cmdstat_ping": {"calls": 0, "usec": 0},
        "cmdstat_info": {"calls": 5, "usec": 20},
    }
    got = c.commandstats_delta(before, after, requests=4)
    assert got["total"] == 6.0  # (20 get + 4 set) / 4, INFO left out
    assert got["server_usec_total"] == 60.0
    assert list(got["top"]) == ["get", "set"]  # by calls
    assert got["top"]["get"] == {"calls": 5.0, "server_usec": 50.0}
    # redis-py may also name them without the prefix
    plain = c.commandstats_delta({"get": {"calls": 1}}, {"get": {"calls": 3}}, 2)
    assert plain["top"] == {"get": {"calls": 1.0, "server_usec": 0.0}}


def test_commandstats_delta_keeps_the_top_commands_only() -> None:
    after = {f"cmdstat_c{i}": {"calls": i + 1, "usec": 1} for i in range(20)}
    got = c.commandstats_delta({}, after, 1)
    assert len(got["top"]) == c.TOP_COMMANDS
    assert next(iter(got["top"])) == "c19"


def test_offsets_delta_names_topics_that_grew() -> None:
    before = {"p.encode": 5, "p.prefill": 2, "p.dlq": 0, "p.results": 10}
    after = {"p.encode": 9, "p.prefill": 6, "p.dlq": 0, "p.results": 26}
    got = c.offsets_delta(before, after, "p", requests=4)
    assert got == {"total": 6.0, "by_topic": {"encode": 1.0, "prefill": 1.0, "results": 4.0}}


def test_floor_counts_the_hops_on_each_critical_path() -> None:
    fl = c.floor_ms(hop_p50_ms=2.0, notify_p50_ms=0.25)
    assert fl == {"new": 2.5, "cached": 2.25}  # new: + the store's notification
    cells = {
        "new": {"c1": {"latency_ms": {"p50": 10.0}}},
        "cached": {"c1": {"latency_ms": {"p50": 5.0}}},
    }
    assert c.overhead_vs_floor(cells, fl) == {"new": 7.5, "cached": 2.75}


def _block(cpu_new: float, rps_cached: float, overhead: float) -> dict[str, Any]:
    def cell(cpu: float, rps: float) -> dict[str, Any]:
        return {"cpu_ms_per_request": {"total": cpu}, "requests_per_s": rps}

    return {
        "cells": {
            "new": {"c16": cell(cpu_new, 100.0)},
            "cached": {"c16": cell(5.0, rps_cached)},
        },
        "idle_cpu_pct": {"total": 1.0},
        "rss_mb": {"results": 120.0, "router": 140.0, "encode": 900.0},
        "overhead_vs_floor_ms": {"new": overhead, "cached": 1.0},
    }


def test_judge_on_apache_and_the_overhead_on_both_brokers() -> None:
    good = {"tansu": _block(50.0, 10.0, 2.0), "apache": _block(10.0, 200.0, 2.5)}
    judged_on, figures, room, met = c.judge(good)
    assert judged_on == "apache" and met
    assert figures["cpu_ms_per_request_new_c16"] == 10.0  # Apache's, not Tansu's 50
    assert figures["rss_mb_results_router"] == 140.0  # the encode worker is not judged
    assert figures["overhead_vs_floor_p50_ms"] == 2.5  # the worst of both
    assert room["requests_per_s_cached_c16"] == pytest.approx(200 / 150, rel=1e-3)
    assert room["cpu_ms_per_request_new_c16"] == pytest.approx(1.2)
    slow_tansu = copy.deepcopy(good)
    slow_tansu["tansu"]["overhead_vs_floor_ms"]["cached"] = 4.0
    assert not c.judge(slow_tansu)[3]  # the overhead counts on Tansu too
    _, _, _, met = c.judge({"tansu": _block(10.0, 200.0, 2.0)})
    assert met  # one broker: judged on it


def test_short_profile_keeps_few_frames_and_says_when_a_process_never_ran() -> None:
    frames = [[f"f{i} (x.py)", 10.0 - i] for i in range(12)]
    summary = {
        "sample_rate_hz": 200,
        "api": {"samples": 40, "waiting_pct": 20.0, "self_pct": frames, "inclusive_pct": frames},
        "router": {"samples": 0, "waiting_pct": 100.0, "self_pct": [], "inclusive_pct": []},
        "results": {"error": "py-spy failed", "raw": "/x"},
    }
    got = c.short_profile(summary, top=3)
    assert got["sample_rate_hz"] == 200
    assert got["api"]["self_pct"] == frames[:3] and got["api"]["waiting_pct"] == 20.0
    assert isinstance(got["router"], str)
    assert got["results"] == {"error": "py-spy failed"}


def test_summarize_can_leave_waiting_threads_out() -> None:
    raw = "\n".join(
        [
            "main (a.py:1);work (runtime/x.py:3);hash (schemas/y.py:9) 6",
            "Thread.run (threading.py:1);Queue.get (queue.py:171);Condition.wait "
            "(threading.py:327) 3",
            "Runner.run (asyncio/runners.py:118);EpollSelector.select (selectors.py:468) 1",
            "_bootstrap (threading.py:1);_worker (concurrent/futures/thread.py:81) 2",
            "submit (frontend/api/routes/requests.py:30);render (producers/render.py:5) 4",
            "main (a.py:1);run (runtime/event_loop.py:37);Runner.run (asyncio/runners.py:118) 4",
        ]
    )
    everything = summarize(raw)
    assert everything["samples"] == 20 and "waiting_pct" not in everything
    busy = summarize(raw, skip_waits=True)
    assert busy["samples"] == 10
    assert busy["waiting_pct"] == 30.0 and busy["event_loop_c_pct"] == 20.0  # of all 20
    assert busy["self_pct"][0] == ["hash (y.py)", 60.0]
    inclusive = dict(busy["inclusive_pct"])
    assert inclusive["submit (requests.py)"] == 40.0  # the front's frames are the project's


def test_sizes_and_the_code_dir() -> None:
    assert c.FULL.with_requests(None) is c.FULL
    sized = c.FULL.with_requests(40)
    assert (sized.requests, sized.tiny_requests) == (40, 10)
    assert c.QUICK.with_requests(40).tiny_requests == 0  # quick runs no tiny-model cells
    assert c.code_env(None) == {}
    env = c.code_env(Path("/some/checkout"))
    assert env == {"PYTHONPATH": "/some/checkout", "PYTHONSAFEPATH": "1"}


def test_coordinator_options_reach_it_only(tmp_path: Path) -> None:
    args = parse_args(["coordinator", "--requests", "12", "--code-dir", str(tmp_path)])
    assert args.names == ["coordinator"]
    assert (args.requests, args.code_dir) == (12, tmp_path)
    assert OPTIONS == {"coordinator": ("code_dir", "requests")}
    assert parse_args([]).requests is None


def test_a_code_dir_without_the_stack_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"epd/cli\.py"):
        c.run(quick=True, code_dir=tmp_path)


def test_tally_monitor_names_each_command_by_its_process() -> None:
    def line(kind: str, port: str, command: str) -> dict[str, Any]:
        return {"client_type": kind, "client_port": port, "command": command}

    lines = [
        line("tcp", "5001", '"GET" "k"'),
        line("tcp", "5001", 'get "k2"'),
        line("tcp", "6001", '"EVALSHA" "abc" "1" "k"'),
        line("lua", "", '"hget" "k" "f"'),  # the script's own, for whoever ran it
        line("lua", "", '"HSET" "k" "f" "v"'),
        line("tcp", "7777", '"PING"'),  # a port no stack process holds
    ]
    got = c.tally_monitor(lines, {"5001": "api", "6001": "prefill"})
    assert got["api"] == {"total": 2, "commands": {"GET": 2}}
    assert got["prefill"] == {
        "total": 3,
        "commands": {"EVALSHA": 1, "lua:HGET": 1, "lua:HSET": 1},
    }
    assert got["other"]["commands"] == {"PING": 1}
