"""The benchmark profiler's pure parts: summarising py-spy samples, CPU time from /proc."""

from __future__ import annotations

import os
from pathlib import Path

from bench.worker_profile import cpu_seconds, idle_cpu, summarize

RAW = "\n".join(
    [
        "<module> (/x/epd/cli.py:10);run (/x/consumers/loop.py:300);"
        "handle (/x/gpu_workers/prefill.py:200);prefill (/x/gpu_workers/compute.py:50);"
        "linear (/site/torch/nn.py:1) 6",
        "<module> (/x/epd/cli.py:10);run (/x/consumers/loop.py:300);"
        "_fetch (/x/consumers/loop.py:420);recv (/usr/lib/socket.py:5) 3",
        "<module> (epd/cli.py:10);run (consumers/loop.py:301);"
        "handle (gpu_workers/prefill.py:210);apply (runtime/status_store.py:90) 1",
        "not a sample line",
    ]
)


def test_summarize_gives_self_and_own_inclusive_shares() -> None:
    s = summarize(RAW)
    assert s["samples"] == 10
    assert s["self_pct"][0] == ["linear (nn.py)", 60.0]
    inclusive = dict((name, pct) for name, pct in s["inclusive_pct"])
    # lines of one function are merged; library frames are not in the inclusive list
    assert inclusive["run (loop.py)"] == 100.0
    assert inclusive["handle (prefill.py)"] == 70.0
    assert "recv (socket.py)" not in inclusive and "linear (nn.py)" not in inclusive
    assert "<module> (cli.py)" not in inclusive  # the entry point is on every stack
    assert summarize("") == {"samples": 0, "self_pct": [], "inclusive_pct": []}


def test_cpu_seconds_and_idle_cpu_of_a_real_process() -> None:
    assert cpu_seconds(os.getpid()) > 0
    got = idle_cpu({"me": os.getpid()}, 0.2)
    assert set(got) == {"me"} and got["me"] >= 0


def test_a_process_never_on_cpu_is_said_to_wait_not_reported_as_zero_samples(
    tmp_path: Path,
) -> None:
    """A worker with nothing to do in the profiled window (the results collector of a quick
    run) gives py-spy no samples: the profile says it waited throughout, as the coordinator
    benchmark's does, instead of a zero a reader would take for a failed measurement."""
    from bench.worker_profile import WAITING_THROUGHOUT, WorkerProfiler

    class Done:
        def poll(self) -> int:
            return 0

        def communicate(self, timeout: float | None = None) -> tuple[bytes, bytes]:
            return b"", b""

    idle, busy = tmp_path / "idle.raw", tmp_path / "busy.raw"
    idle.write_text("")
    busy.write_text(RAW)
    prof = WorkerProfiler({}, tmp_path)
    prof._procs = {"idle": (Done(), idle), "busy": (Done(), busy)}  # type: ignore[dict-item]
    out = prof.stop()
    assert out["idle"] == WAITING_THROUGHOUT
    assert out["busy"]["samples"] == 10 and out["busy"]["raw"] == str(busy)


def test_context_switches_count_the_waits_of_every_thread_and_child() -> None:
    import subprocess
    import sys
    import threading
    import time

    from bench.worker_profile import context_switches, switches_per_request

    me = os.getpid()
    before = context_switches(me)
    slept, done = threading.Event(), threading.Event()

    def sleeper() -> None:
        for _ in range(50):
            time.sleep(0.001)  # each sleep is one wait, then a wake-up
        slept.set()
        done.wait()  # alive until read: an ended thread's waits are no longer counted

    waited = threading.Thread(target=sleeper)
    waited.start()
    for _ in range(50):
        time.sleep(0.001)
    assert slept.wait(30)
    both = context_switches(me)
    done.set()
    waited.join()
    assert both - before >= 90, (before, both)
    # A live child's waits count for its parent (the API's image decoders are its cost too).
    base = context_switches(me)
    script = (
        "import time\nfor _ in range(200): time.sleep(0.001)\nprint('slept', flush=True)\ninput()"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"slept\n"
        with_child = context_switches(me)  # it waits for a line now, alive
    finally:
        child.communicate(b"\n", timeout=10)
    assert with_child - base >= 180, (base, with_child)
    per = switches_per_request({"api": 10, "broker": 0}, {"api": 70, "broker": 30}, 20)
    assert per == {"api": 3.0, "broker": 1.5, "total": 4.5}
