"""``epd stack``'s supervisor, on stand-in worker processes (pure logic: the real one is
killed -9 under ``epd stack`` in tests/integration/test_readme_stack.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import epd.supervisor as sup
from epd.supervisor import Supervisor


class _Proc:
    def __init__(self, pid: int, code: int | None = None) -> None:
        self.pid, self.returncode = pid, code


class _Workers:
    def __init__(self, tmp: Path) -> None:
        self.procs: list[tuple[str, Any, Path]] = []
        self.ready_files: list[Path] = []
        for i, kind in enumerate(("encode", "prefill")):
            log = tmp / f"{kind}.log"
            log.write_text(f"epd: {kind} fell over\n")
            self.procs.append((kind, _Proc(100 + i), log))
            self.ready_files.append(tmp / f"{kind}.ready")
        self.respawned: list[int] = []

    def exited(self) -> list[int]:
        return [i for i, (_, p, _) in enumerate(self.procs) if p.returncode is not None]

    def respawn(self, index: int) -> None:
        kind, _, log = self.procs[index]
        self.procs[index] = (kind, _Proc(200 + len(self.respawned)), log)
        self.respawned.append(index)


async def test_each_dead_worker_waits_its_own_growing_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(sup.time, "monotonic", lambda: clock[0])
    workers, said = _Workers(tmp_path), list[str]()
    supervisor = Supervisor(workers, said.append)  # type: ignore[arg-type]
    workers.procs[0][1].returncode = -9
    workers.procs[1][1].returncode = 1
    await supervisor.tick()
    assert said == [
        "the encode worker exited with -9: encode fell over (log: "
        f"{tmp_path / 'encode.log'}); restarting it in 1 s",
        f"the prefill worker exited with 1: prefill fell over (log: {tmp_path / 'prefill.log'})"
        "; restarting it in 1 s",
    ]
    assert workers.respawned == []  # not before its backoff
    clock[0] += 1.0
    await supervisor.tick()
    assert workers.respawned == [0, 1]  # both, neither waiting on the other
    workers.ready_files[0].write_text("pid")
    await supervisor.tick()
    assert said[-1] == "the encode worker is back (pid 200, holds partitions)"
    # encode dies again at once: its backoff doubles; prefill's does not move.
    workers.procs[0][1].returncode = -9
    clock[0] += 5.0
    await supervisor.tick()
    assert said[-1].endswith("restarting it in 2 s")
    clock[0] += 1.0
    await supervisor.tick()
    assert workers.respawned == [0, 1]
    clock[0] += 1.0
    await supervisor.tick()
    assert workers.respawned == [0, 1, 0]
    # Alive past STEADY_S, then dead again: back to the first backoff.
    clock[0] += sup.STEADY_S + 1
    workers.procs[0][1].returncode = -9
    await supervisor.tick()
    assert said[-1].endswith("restarting it in 1 s")


async def test_a_supervisor_that_fails_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workers, said = _Workers(tmp_path), list[str]()

    def broken(index: int) -> None:
        raise OSError("no more processes")

    workers.respawn = broken  # type: ignore[method-assign]
    workers.procs[0][1].returncode = -9
    supervisor = Supervisor(workers, said.append, check_s=0.01)  # type: ignore[arg-type]
    monkeypatch.setattr(sup, "FIRST_BACKOFF_S", 0.0)
    with pytest.raises(OSError):
        await supervisor.run()
    assert said[-1] == (
        "the worker supervisor stopped: OSError('no more processes'); dead workers stay dead"
    )
