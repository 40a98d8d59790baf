"""Where worker time goes: py-spy samples of worker processes, and their CPU at idle.

``WorkerProfiler`` runs ``py-spy record`` (raw, collapsed stacks; idle threads left out) against
each worker process while a benchmark drives it, and summarises the samples per worker: the
functions most often on CPU themselves (``self``) and the project's own functions most often on
the stack (``inclusive``). Without ``py-spy`` on PATH (or in the venv) it says so and measures
nothing. ``idle_cpu`` reads ``/proc`` CPU time of idle workers over a few seconds: the cost of
waiting (fetch polls, heartbeats) beside the latency it buys.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import sig

SAMPLE_RATE_HZ = 200
TOP = 12
OWN_FRAME = re.compile(
    r"\((?:.*/)?(?:runtime|producers|consumers|gpu_workers|schemas|epd|frontend|media)/"
    r"(?:[^/]+/)*[^/]+\.py:"
)
"""A frame of the project's own code: py-spy names files relative to sys.path or in full."""
ENTRY_FRAME = re.compile(
    r"\((?:.*/)?(?:epd/(?:cli|stages|commands/worker|commands/api)|consumers/(?:dispatch|runner)"
    r"|runtime/event_loop)\.py:"
)
"""The process's entry point, or the consume loop's plumbing around every handler: on (almost)
every stack, so not worth a line of the summary (the handler's own frame says as much)."""
WAIT_LEAF = re.compile(
    r"^(?:Condition\.wait|Event\.wait) \((?:.*/)?threading\.py:"
    r"|^_worker \((?:.*/)?concurrent/futures/thread\.py:"
    r"|^\w*Selector\.select \((?:.*/)?selectors\.py:"
)
"""A sample's last frame that is a thread waiting (an idle pool thread, an event loop in
``select``), which py-spy's idle detection lets through: ``summarize(skip_waits=True)`` counts
them apart."""
C_LOOP_LEAF = re.compile(r"^Runner\.run \((?:.*/)?asyncio/runners\.py:")
"""A sample whose last Python frame is ``asyncio.Runner.run``: the thread is inside uvloop's C
loop (libuv's I/O and callbacks, or its epoll wait; py-spy cannot tell which), so
``summarize(skip_waits=True)`` counts it apart too (``event_loop_c_pct``)."""


def py_spy() -> str | None:
    """The py-spy binary: beside this interpreter (the venv) or on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def _stat(pid: int, tid: str | None = None) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` (of its thread ``tid``'s, if given) after the
    command name (None once it is gone)."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        return Path(path).read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _own_ticks(fields: list[str]) -> int:
    """User + system clock ticks from :func:`_stat`'s fields (not its reaped children's)."""
    return int(fields[11]) + int(fields[12])


def _descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, theirs, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        out.append(child)
        todo.extend(children.get(child, ()))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far, with its live descendants' and the children
    it reaped (the API's image decoder processes are its cost too); 0 once it is gone."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    for child in _descendants(pid):
        if (sub := _stat(child)) is not None:
            ticks += _own_ticks(sub)
    return ticks / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int | None) -> float | None:
    """Resident set size of ``pid`` in MiB from ``/proc/<pid>/status``; None if unreadable."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def pss_mb(pid: int | None) -> float | None:
    """Proportional set size of ``pid`` in MiB (``/proc/<pid>/smaps_rollup``: shared pages, such
    as the libraries every worker maps, split among the processes that map them); None if
    unreadable."""
    if not pid:
        return None
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this host (the broker, Redis), if it can be
    seen from here (not in another network namespace, permissions allowing)."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
                return conn.pid
    except (psutil.Error, OSError):
        return None
    return None


class CpuMeter:
    """CPU milliseconds that each of several processes spends per request over a set of them:
    the cost an overhead figure hides when the processes share a few cores."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self._start = self._now()

    def _now(self) -> dict[str, float]:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def restart(self) -> None:
        self._start = self._now()

    def per_request(self, requests: int) -> dict[str, float]:
        """ms of CPU per request since the last (re)start, per process and in total."""
        now = self._now()
        out = {
            name: sig(1000 * (now[name] - self._start[name]) / max(1, requests))
            for name in self.pids
        }
        out["total"] = sig(sum(out.values()))
        return out


def context_switches(pid: int) -> int:
    """Times the threads of ``pid`` and of its live descendants went to sleep to wait so far
    (voluntary context switches: each ends with a wake-up, what a message between processes
    costs); threads that ended are not counted (``/proc/<pid>/task/*/status``)."""
    total = 0
    for proc in (pid, *_descendants(pid)):
        try:
            tids = os.listdir(f"/proc/{proc}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            try:
                text = Path(f"/proc/{proc}/task/{tid}/status").read_text()
            except OSError:
                continue  # the thread ended
            for line in text.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split(":", 1)[1])
    return total


def switches_per_request(
    before: dict[str, int], after: dict[str, int], requests: int
) -> dict[str, float]:
    """:func:`context_switches` per request of each process between two readings, and their
    total."""
    out = {name: sig((after[name] - before[name]) / max(1, requests)) for name in before}
    out["total"] = sig(sum(out.values()))
    return out


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each process's CPU use in % of one core over ``seconds`` of doing nothing."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    return {
        name: sig(100 * (cpu_seconds(pid) - before[name]) / seconds) for name, pid in pids.items()
    }


def thread_cpu(pid: int) -> dict[str, int]:
    """Clock ticks of CPU each thread of ``pid`` used so far, summed by thread name (a JVM's
    threads are named: its compilers, GC, timers and Kafka's own)."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue  # the thread ended
        if (fields := _stat(pid, tid)) is not None:
            out[name] = out.get(name, 0) + _own_ticks(fields)
    return out


def busiest_threads(
    pid: int, before: dict[str, int], seconds: float, top: int = 8
) -> dict[str, float]:
    """% of one core each named thread of ``pid`` used since ``before`` (:func:`thread_cpu`),
    the busiest ``top`` of them."""
    hz = os.sysconf("SC_CLK_TCK")
    now = thread_cpu(pid)
    used = {name: ticks - before.get(name, 0) for name, ticks in now.items()}
    ranked = sorted(((n, t) for n, t in used.items() if t > 0), key=lambda x: -x[1])[:top]
    return {name: sig(100 * ticks / hz / seconds) for name, ticks in ranked}


def _frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: lines merged, paths shortened."""
    func, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{func} ({Path(path).name})" if path else func


def summarize(raw: str, *, skip_waits: bool = False) -> dict[str, Any]:
    """Self and inclusive shares (% of samples) from py-spy's raw collapsed-stack output;
    ``skip_waits``: samples of a waiting thread (:data:`WAIT_LEAF`) and of uvloop's C loop
    (:data:`C_LOOP_LEAF`) are left out of the shares, counted as ``waiting_pct`` and
    ``event_loop_c_pct`` of all samples instead (``samples`` is then the rest: Python code)."""
    own_self: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = waiting = c_loop = 0
    for line in raw.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        n = int(count_s)
        frames = stack.split(";")
        if skip_waits and WAIT_LEAF.search(frames[-1]):
            waiting += n
            continue
        if skip_waits and C_LOOP_LEAF.search(frames[-1]):
            c_loop += n
            continue
        total += n
        own_self[_frame_name(frames[-1])] += n
        own = {_frame_name(f) for f in frames if OWN_FRAME.search(f) and not ENTRY_FRAME.search(f)}
        for name in own:
            inclusive[name] += n

    def top(c: Counter[str]) -> list[list[Any]]:
        return [[name, sig(100 * n / total)] for name, n in c.most_common(TOP)] if total else []

    out: dict[str, Any] = {"samples": total}
    if skip_waits:
        every = total + waiting + c_loop
        out["waiting_pct"] = sig(100 * waiting / every) if every else 0.0
        out["event_loop_c_pct"] = sig(100 * c_loop / every) if every else 0.0
    return {**out, "self_pct": top(own_self), "inclusive_pct": top(inclusive)}


WAITING_THROUGHOUT = "no samples on CPU: waiting throughout"
"""A profiled process that py-spy never found on CPU (a worker with nothing to do in the
window): said so, not reported as zero samples."""


@dataclass
class WorkerProfiler:
    """py-spy on each of ``pids`` between :meth:`start` and :meth:`stop`."""

    pids: dict[str, int]
    out_dir: Path
    skip_waits: bool = False
    """Summaries leave waiting threads' samples out (:func:`summarize`)."""
    _procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = field(default_factory=dict)
    skipped: str | None = None

    def start(self) -> None:
        exe = py_spy()
        if exe is None:
            self.skipped = "py-spy not installed (pip install py-spy)"
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        for name, pid in self.pids.items():
            path = self.out_dir / f"{name}.raw"
            cmd = [exe, "record", "-p", str(pid), "-r", str(SAMPLE_RATE_HZ), "-f", "raw"]
            cmd += ["-o", str(path), "--nonblocking"]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._procs[name] = (proc, path)

    def stop(self) -> dict[str, Any]:
        """Stop sampling (py-spy writes its file on SIGINT) and summarise each worker."""
        if self.skipped:
            return {"skipped": self.skipped}
        out: dict[str, Any] = {"sample_rate_hz": SAMPLE_RATE_HZ}
        for name, (proc, path) in self._procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            try:
                _, err = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if path.exists():
                summary = summarize(path.read_text(), skip_waits=self.skip_waits)
                out[name] = (
                    {**summary, "raw": str(path)} if summary["samples"] else WAITING_THROUGHOUT
                )
            else:
                out[name] = {"error": err.decode(errors="replace").strip()[-300:]}
        return out
