"""``epd.services.processes.spawn``: the tie to the starting thread, made without Python code
between fork and exec (which can deadlock a process with threads)."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from epd.services.processes import pid_alive, spawn, stop_process

SLEEP = shutil.which("sleep") or "/bin/sleep"


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_tied_child_runs_its_command_under_the_pid_spawn_returns(tmp_path: Path) -> None:
    proc = spawn([SLEEP, "30"], tmp_path / "log", cwd=tmp_path, tie_to_parent=True)
    try:
        # No launcher left in its place: the pid-reuse guard sees the command at once.
        assert os.path.realpath(f"/proc/{proc.pid}/exe") == os.path.realpath(SLEEP)
        assert pid_alive(proc.pid, [SLEEP])
    finally:
        stop_process(proc.pid, [SLEEP])
        proc.wait()


def test_a_tied_child_gets_sigterm_when_the_thread_that_started_it_ends(tmp_path: Path) -> None:
    started: list[int] = []

    def start() -> None:
        started.append(spawn([SLEEP, "60"], tmp_path / "log", cwd=tmp_path, tie_to_parent=True).pid)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    (pid,) = started
    try:
        assert _gone(pid, within_s=10), "the tied child outlived the thread that started it"
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 15
    finally:
        if pid_alive(pid):
            os.kill(pid, 9)


def test_an_untied_child_outlives_the_thread_that_started_it(tmp_path: Path) -> None:
    started: list[int] = []

    def start() -> None:
        started.append(
            spawn([SLEEP, "60"], tmp_path / "log", cwd=tmp_path, tie_to_parent=False).pid
        )

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    (pid,) = started
    try:
        assert not _gone(pid, within_s=1)
    finally:
        stop_process(pid, [SLEEP])  # it reaps its own child


@pytest.mark.parametrize("tie", [True, False])
def test_a_program_that_is_not_there_raises_as_popen_does(tmp_path: Path, tie: bool) -> None:
    with pytest.raises(FileNotFoundError):
        spawn(
            [str(tmp_path / "no-such-program")], tmp_path / "log", cwd=tmp_path, tie_to_parent=tie
        )


def test_a_tied_spawn_leaves_no_descriptor_behind(tmp_path: Path) -> None:
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        proc = spawn([SLEEP, "30"], tmp_path / "log", cwd=tmp_path, tie_to_parent=True)
        stop_process(proc.pid, [SLEEP])
        proc.wait()
    with pytest.raises(FileNotFoundError):
        spawn([str(tmp_path / "missing")], tmp_path / "log", cwd=tmp_path, tie_to_parent=True)
    assert set(os.listdir("/proc/self/fd")) <= before
