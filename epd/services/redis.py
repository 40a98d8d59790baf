"""A local ``redis-server``: no persistence, bound to 127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from epd.services.config import LocalServices
from epd.services.probes import redis_answers
from epd.services.processes import free_port, port_bindable, spawn, stop_process, wait_until
from epd.services.state import ServiceError, ServiceRecord
from runtime.settings import Settings

DEFAULT_REDIS_URL: str = Settings.model_fields["redis_url"].default
REDIS_INSTALL_HINT = (
    "redis-server not found on PATH; install it (Debian/Ubuntu: `apt-get install redis-server`, "
    "macOS: `brew install redis`) or point EPD_REDIS_URL at a running Redis"
)


def _redis_url_with_port(url: str, port: int) -> str:
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")
    auth = netloc[0] + "@" if netloc[1] else ""
    return urlunsplit((parts.scheme, f"{auth}127.0.0.1:{port}", parts.path, parts.query, ""))


def start_redis(
    directory: Path,
    url: str = DEFAULT_REDIS_URL,
    *,
    log_dir: Path | None = None,
    timeout_s: float = 15.0,
    tie_to_parent: bool = False,
) -> ServiceRecord:
    """Start ``redis-server`` on 127.0.0.1 (the URL's port when free, else a free one), no disk,
    at ``EPD_REDIS_HZ``."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ServiceError(REDIS_INSTALL_HINT)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", ""):
        raise ServiceError(f"cannot start a local Redis for {url!r}: only redis:// URLs")
    wanted = parts.port or 6379
    local = parts.hostname in (None, "127.0.0.1", "localhost", "::1")
    port = wanted if local and port_bindable(wanted) else free_port()
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
        "--hz",
        str(LocalServices().redis_hz),
    ]
    if parts.password:
        cmd += ["--requirepass", parts.password]
    proc = spawn(cmd, log, cwd=directory, tie_to_parent=tie_to_parent)
    new_url = _redis_url_with_port(url if parts.scheme else DEFAULT_REDIS_URL, port)
    if not wait_until(lambda: redis_answers(new_url), timeout_s, alive=lambda: proc.poll() is None):
        stop_process(proc.pid, cmd)
        proc.wait()
        raise ServiceError(f"redis-server did not come up on 127.0.0.1:{port}; see {log}")
    return ServiceRecord("redis", new_url, True, proc.pid, cmd, str(log))
