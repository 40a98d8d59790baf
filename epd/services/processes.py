"""Child processes of the local services: spawn, liveness (with a pid-reuse guard), stop."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def port_bindable(port: int) -> bool:
    """Whether a server could bind ``127.0.0.1:port`` now (SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # A port whose last owner just stopped, with connections left in TIME_WAIT, is free
        # for them, so a restart keeps its address.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(check: Callable[[], bool], timeout_s: float, *, alive: Callable[[], bool]) -> bool:
    """Poll ``check`` with a growing pause until it holds, ``alive`` fails, or time runs out."""
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while True:
        if check():
            return True
        if not alive() or time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.5)


# ---------------------------------------------------------------- processes


# Why a launcher and not ``preexec_fn``: Python code between fork and exec can deadlock in a
# process with threads (a lock another thread held at the fork stays held in the child), and then
# ``Popen`` waits on the child for ever. A test worker starts services mid-session, beside its
# event loop's and Kafka clients' threads, so the tie is made by a fresh, single-threaded Python
# that execs the command in its own place (same pid) once it is tied.
_TIED_LAUNCHER = """\
import ctypes, os, signal, sys
parent, ready, cmd = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)
except Exception:
    pass
if os.getppid() != parent:
    sys.exit(1)  # the starter died before the tie held: nobody is left to stop the command
os.set_inheritable(ready, False)  # exec closes it: the starter reads end-of-file
try:
    os.execvp(cmd[0], cmd)
except OSError as exc:
    os.write(ready, f"{exc.errno} {exc.strerror}".encode())
    sys.exit(127)
"""
EXEC_TIMEOUT_S = 30.0
"""How long a tied child may take to reach its command's exec."""


def _awaiting_exec(read_fd: int, proc: subprocess.Popen[bytes], program: str) -> None:
    """Block until the launcher has exec'd ``program`` (end-of-file on ``read_fd``); raise
    ``OSError`` as ``Popen`` would when the exec failed or the launcher never got there."""
    deadline = time.monotonic() + EXEC_TIMEOUT_S
    failure = b""
    while (left := deadline - time.monotonic()) > 0:
        if select.select([read_fd], [], [], left)[0]:
            chunk = os.read(read_fd, 512)
            if not chunk:
                break
            failure += chunk
    else:
        proc.kill()
        proc.wait()
        raise OSError(f"{program}: not started within {EXEC_TIMEOUT_S:.0f} s")
    if failure:
        errno_text, _, reason = failure.decode(errors="replace").partition(" ")
        proc.wait()
        number = int(errno_text) if errno_text.isdigit() else 0
        raise OSError(number, reason or "the launcher exited before exec", program)


def _launch_tied(cmd: list[str]) -> tuple[list[str], int, int]:
    """The launcher's command line for ``cmd`` and the pipe it reports its exec on."""
    read_fd, write_fd = os.pipe()
    launcher = [sys.executable, "-I", "-S", "-c", _TIED_LAUNCHER, str(os.getpid()), str(write_fd)]
    return [*launcher, *cmd], read_fd, write_fd


def spawn(cmd: list[str], log: Path, *, cwd: Path, tie_to_parent: bool) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session with stdin closed and output appended to ``log``;
    ``tie_to_parent``: it gets SIGTERM when the thread that started it dies (Linux)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTENER_", "ADVERTISED_"))}
    tied = tie_to_parent and os.name == "posix"
    argv, read_fd, write_fd = _launch_tied(cmd) if tied else (cmd, -1, -1)
    try:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                env=env,
                close_fds=True,
                pass_fds=(write_fd,) if tied else (),
                start_new_session=True,  # a Ctrl-C aimed at the caller's terminal does not reach it
            )
        if tied:
            os.close(write_fd)
            write_fd = -1
            _awaiting_exec(read_fd, proc, cmd[0])
    finally:
        for fd in (read_fd, write_fd):
            if fd >= 0:
                os.close(fd)
    return proc


def pid_alive(pid: int | None, command: list[str] | None = None) -> bool:
    """True when ``pid`` runs and, if ``command`` is given, runs that program (pid reuse guard)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rpartition(")")[2].split()[0] == "Z":
            return False  # a zombie is dead; only its parent has not reaped it yet
    if command:
        return _runs_program(pid, command[0])
    return True


def _runs_program(pid: int, program: str) -> bool:
    """Whether ``pid`` executes ``program`` (guards against a recycled pid)."""
    want = Path(program).name
    with contextlib.suppress(OSError):
        # Debian's redis-server is a symlink to redis-check-rdb: compare resolved paths too.
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
        if Path(exe).name == want or exe == os.path.realpath(program):
            return True
    try:
        # redis-server rewrites its title ("/usr/bin/redis-server 127.0.0.1:6379"), so take the
        # first word of the command line.
        raw = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return not Path("/proc").is_dir()  # no /proc (not Linux): trust the signal probe
    return Path(raw.split(" ")[0]).name == want


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop_process(
    pid: int | None, command: list[str] | None = None, timeout_s: float = 10.0
) -> bool:
    """SIGTERM the process (and its session's group), SIGKILL after ``timeout_s``; True if ended."""
    if not pid_alive(pid, command):
        return False
    assert pid is not None

    def signal_all(sig: signal.Signals) -> None:
        try:
            os.killpg(pid, sig)  # the child leads its own session, so its group has its pid
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    signal_all(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pid)
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    signal_all(signal.SIGKILL)
    for _ in range(100):
        _reap(pid)
        if not pid_alive(pid):
            break
        time.sleep(0.05)
    return True
