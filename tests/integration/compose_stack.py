"""docker-compose.yml run for real, on a machine without a registry: local images that honour
the public images' contracts (``docker/build-images.sh``: ``epd-kafka`` takes the official
image's ``KAFKA_*`` variables, ``epd-redis`` runs ``redis-server ...`` as the official one does,
``epd-python`` is docker/Dockerfile's base), passed through the compose file's image variables,
with docker/compose.cpu.yml's CPU workers.

Compose v1 (Debian's docker-compose 1.29, what CI installs) cannot read compose.cpu.yml's
``!reset``: the stack runs compose's own rendering of docker-compose.yml (``config``: variables
interpolated, the file validated) with the override applied as Compose v2 applies it
(:func:`apply_override`), so both compose generations run the same two files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
CPU_OVERRIDE = REPO / "docker" / "compose.cpu.yml"
BUILD_IMAGES = REPO / "docker" / "build-images.sh"
# What docker/Dockerfile copies into the app image: its tag hashes these (and the base), so an
# unchanged tree reuses the image and any change builds a new one.
APP_SOURCES = (
    "docker/Dockerfile",
    ".dockerignore",
    "pyproject.toml",
    "README.md",
    "schemas",
    "runtime",
    "media",
    "epd",
    "producers",
    "frontend",
    "consumers",
    "gpu_workers",
)


class ComposeUnavailable(RuntimeError):
    """No compose command or no Docker daemon: the test skips (fails under CI=true)."""


def compose_command() -> list[str]:
    """``docker compose`` (v2) where the plugin answers, else ``docker-compose`` (v1)."""
    if shutil.which("docker") is None:
        raise ComposeUnavailable("no docker client on PATH")
    if _ok(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose") and _ok(["docker-compose", "version"]):
        return ["docker-compose"]
    raise ComposeUnavailable("neither `docker compose` nor docker-compose is installed")


def _ok(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True, check=False, timeout=60).returncode == 0


def require_docker() -> None:
    """A daemon answers (docker/ensure-dockerd.sh starts one)."""
    if not _ok(["docker", "info"]):
        raise ComposeUnavailable("no Docker daemon answers (docker/ensure-dockerd.sh)")


class _Reset:
    """Compose v2's ``!reset``: the key is removed from the merged service."""


RESET = _Reset()


class _OverrideLoader(yaml.SafeLoader):
    pass


_OverrideLoader.add_constructor("!reset", lambda loader, node: RESET)


def load_override(path: Path = CPU_OVERRIDE) -> dict[str, Any]:
    """An override file, its ``!reset`` values as :data:`RESET`."""
    # A SafeLoader with the one tag added: nothing but plain data is constructed.
    data: dict[str, Any] = yaml.load(path.read_text(), Loader=_OverrideLoader)
    return data


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if value is RESET:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def apply_override(rendered: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``rendered`` (a compose file) with ``override``'s services merged in as Compose merges
    them: mappings merge key by key, other values replace, ``!reset`` removes."""
    services = dict(rendered["services"])
    for name, over in override.get("services", {}).items():
        services[name] = _merge(services[name], over)
    return {**rendered, "services": services}


def build_images(names: Iterable[str]) -> dict[str, str]:
    """``{name: image}`` from docker/build-images.sh (each built once, then reused by tag)."""
    from tests.services import machine_lock

    env = {**os.environ, "PYTHON": str(REPO / ".venv" / "bin" / "python")}
    if not Path(env["PYTHON"]).exists():
        env["PYTHON"] = shutil.which("python3") or "python3"
    with machine_lock("images"):
        proc = subprocess.run(
            ["bash", str(BUILD_IMAGES), *names],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"docker/build-images.sh failed:\n{proc.stderr[-4000:]}")
    return dict(line.split("=", 1) for line in proc.stdout.split() if "=" in line)


def app_image_tag(base_image: str) -> str:
    """``epd-pipeline:<hash>`` of the base image and every file the Dockerfile copies."""
    digest = hashlib.sha256(base_image.encode())
    for name in APP_SOURCES:
        path = REPO / name
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            if "__pycache__" in f.parts:
                continue
            digest.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    return f"epd-pipeline:{digest.hexdigest()[:12]}"


def image_present(image: str) -> bool:
    return _ok(["docker", "image", "inspect", image])


@dataclass
class ComposeStack:
    """One compose project (its own name, ports and volume) of docker-compose.yml with the CPU
    override, driven through the compose CLI."""

    compose: list[str]
    project: str
    workdir: Path
    env: dict[str, str]
    log: list[str] = field(default_factory=list)

    @property
    def file(self) -> Path:
        return self.workdir / "stack.yml"

    def render(self) -> None:
        """Write the stack file: compose's rendering of docker-compose.yml (with the .env
        written beside it), then docker/compose.cpu.yml applied."""
        env_file = self.workdir / ".env"
        env_file.write_text("".join(f"{k}={v}\n" for k, v in self.env.items()))
        out = self.run("-f", str(COMPOSE_FILE), "--env-file", str(env_file), "config")
        stack = apply_override(yaml.safe_load(out), load_override())
        self.file.write_text(yaml.safe_dump(stack, sort_keys=False))

    def run(self, *args: str, timeout: float = 600.0) -> str:
        """A compose command on this project; its output, or RuntimeError with it."""
        files = [] if "-f" in args else ["-f", str(self.file)]
        cmd = [*self.compose, "-p", self.project, *files, *args]
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=self.workdir,
            env={**os.environ, **self.env},
            timeout=timeout,
            check=False,
        )
        self.log.append(f"$ {' '.join(cmd)} -> {proc.returncode}")
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc.stdout

    def containers(self, service: str) -> list[str]:
        """Ids of the service's containers (running or not)."""
        return self.run("ps", "-q", service).split()

    def logs(self, tail: int = 40) -> str:
        try:
            return self.run("logs", "--no-color", "--tail", str(tail), timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return f"(no logs: {exc})"

    def down(self) -> None:
        self.run("down", "-v", "--remove-orphans", "--timeout", "10")


def inspect(container: str) -> dict[str, Any]:
    """``docker inspect`` of one container."""
    out = subprocess.run(
        ["docker", "inspect", container], capture_output=True, text=True, check=True
    ).stdout
    found: list[dict[str, Any]] = json.loads(out)
    return found[0]


def kill_main_process(container: str) -> int:
    """SIGKILL the container's main process from the host, as a crash or the OOM killer would:
    unlike ``docker kill``, which marks the container stopped by hand, this leaves its restart
    policy in charge. Returns the RestartCount before the kill."""
    state = inspect(container)
    os.kill(int(state["State"]["Pid"]), 9)
    count: int = state["RestartCount"]
    return count


def wait_restarted(container: str, after: int, timeout_s: float = 120.0) -> dict[str, Any]:
    """The container's state once its RestartCount passed ``after`` and it runs again."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = inspect(container)
        if state["RestartCount"] > after and state["State"]["Running"]:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"{container} did not come back: {state['State']}")
        time.sleep(0.5)
