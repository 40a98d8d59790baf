"""A worker process outlives no supervisor: killed -9, ``epd stack`` (or any ``WorkerProcesses``
owner) leaves no worker behind burning CPU and holding partitions (``--exit-with-parent``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from epd.local_pipeline import child_env, worker_env
from runtime.settings import Settings

pytestmark = pytest.mark.integration

SUPERVISOR = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from epd.local_pipeline import WorkerProcesses
    workers = WorkerProcesses(dict(os.environ), Path(sys.argv[1]), ["results"])
    workers.start()
    print(workers.procs[0][1].pid, flush=True)
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent, init, reaps it).
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_killed_supervisors_workers_stop(settings: Settings, tmp_path: Path) -> None:
    env = child_env(worker_env(settings))
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    sup = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sup.stdout is not None
    worker = int(sup.stdout.readline())
    try:
        time.sleep(1.0)
        assert _alive(worker)
        sup.send_signal(signal.SIGKILL)
        sup.wait(10)
        end = time.monotonic() + 30
        while _alive(worker) and time.monotonic() < end:
            time.sleep(0.2)
        assert not _alive(worker), "the worker outlived its killed supervisor"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
