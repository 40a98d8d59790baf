"""The local services' state file: what ``epd up`` started, so ``epd down`` stops just that."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from epd.services.config import LocalServices

STATE_FILE = "services.json"


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
    kind: str | None = None
    """The embedded broker this record is (``apache``, ``tansu``); None for anything else."""


@dataclass(slots=True)
class ServicesState:
    """What one ``up`` produced: the services and the environment that points at them."""

    kafka: ServiceRecord
    redis: ServiceRecord
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)
    """What the start wants the user told (a broker fallback); not recorded."""
    redis_nodes: list[ServiceRecord] = field(default_factory=list)
    """The node processes of a local Redis Cluster (``redis`` then holds its URL)."""

    def started(self) -> list[ServiceRecord]:
        """The records of processes that were started here (the ones a stop may end)."""
        return [r for r in (self.kafka, self.redis, *self.redis_nodes) if r.started]


def state_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The state directory: ``path``, else ``$EPD_STATE_DIR``, else ``.epd`` under the cwd."""
    if path is not None:
        return Path(path)
    configured = LocalServices().state_dir
    return configured if configured is not None else Path.cwd() / ".epd"


def load_state(directory: Path) -> ServicesState | None:
    """The recorded state, or None when nothing is recorded (or the file is unreadable)."""
    try:
        raw = json.loads((directory / STATE_FILE).read_text())
        return ServicesState(
            kafka=ServiceRecord(**raw["kafka"]),
            redis=ServiceRecord(**raw["redis"]),
            env=dict(raw["env"]),
            redis_nodes=[ServiceRecord(**r) for r in raw.get("redis_nodes", [])],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_state(directory: Path, state: ServicesState) -> None:
    """Write the state file atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{STATE_FILE}.{os.getpid()}.tmp"
    payload = {
        "kafka": asdict(state.kafka),
        "redis": asdict(state.redis),
        "env": state.env,
        "redis_nodes": [asdict(r) for r in state.redis_nodes],
    }
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, directory / STATE_FILE)


def clear_state(directory: Path) -> None:
    """Forget the recorded state."""
    with contextlib.suppress(FileNotFoundError):
        (directory / STATE_FILE).unlink()
