"""What a worker says of itself in the fleet, and what must agree between it and the API.

An announcement is a small JSON object in one Redis hash (:attr:`schemas.keys.RedisKeys.fleet`),
rewritten every ``EPD_FLEET_ANNOUNCE_S`` and live until its own ``expires_ms``. Secrets never
travel: the EC secret appears as a keyed digest, so two processes can tell whether they share
one without either learning it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.settings import Settings

MAX_ANNOUNCEMENT_BYTES = 16 * 1024
"""An entry larger than this is not read (the hash is shared: one bad writer must not make every
reader parse megabytes)."""
MAX_PARTITIONS = 1024
"""Partitions listed per announcement (a worker holding more lists the first ones)."""
_SECRET_LABEL = b"epd-fleet-ec-secret-v1"


def secret_fingerprint(secret: bytes | None) -> str:
    """A digest of the EC secret keyed by the secret itself: equal for equal secrets, and
    nothing about the secret can be read from it ("none" without a secret)."""
    if not secret:
        return "none"
    return hmac.new(secret, _SECRET_LABEL, hashlib.sha256).hexdigest()[:16]


def shared_settings(settings: Settings) -> dict[str, Any]:
    """The settings on which the API and every worker must agree for a request to get through:
    the EC namespace (where embedding keys may live) and whether prefill hands off to a decode
    stage. The topic prefix needs no check: a worker under another prefix announces under it
    and is simply not in this fleet."""
    return {"ec_namespace": settings.ec_namespace, "decode_stage": settings.decode_stage}


def settings_fingerprint(settings: Settings) -> str:
    """A short digest of :func:`shared_settings`."""
    text = json.dumps(shared_settings(settings), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def engine_of(settings: Settings) -> str:
    """The engine that computes for a worker of these settings: ``EPD_ENGINE`` (``vllm`` or
    ``transformers``), or ``instant``, the benchmark's engine that computes nothing."""
    return "instant" if settings.model == "instant" else settings.engine


def package_version() -> str:
    """This package's version (``unknown`` when it is run from a tree that was not installed)."""
    try:
        return metadata.version("epd-pipeline")
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True, slots=True)
class Announcement:
    """One worker, as it last said of itself."""

    worker_id: str
    stage: str
    model: str
    """The served model ("" for a stage that loads none: results)."""
    engine: str
    version: str
    ec_secret: str
    """:func:`secret_fingerprint` of its EC secret ("" for a stage that signs nothing)."""
    settings: str
    """:func:`settings_fingerprint` of its settings."""
    partitions: tuple[str, ...]
    """``topic:partition`` it holds."""
    in_flight: int
    handled: int
    """Records handled since it started."""
    last_handled_ms: int | None
    started_ms: int
    announced_ms: int
    expires_ms: int

    def live(self, now_ms: int) -> bool:
        """Whether the announcement still counts the worker in."""
        return now_ms < self.expires_ms

    def to_json(self) -> str:
        """The stored form."""
        return json.dumps(asdict(self), separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (``epd status --json``, the admin route)."""
        return asdict(self)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Announcement | None:
        """The announcement ``raw`` holds, or None when it is not one (too large, not JSON, a
        field missing or of the wrong type): a bad entry is skipped, never fatal to a reader."""
        if len(raw) > MAX_ANNOUNCEMENT_BYTES:
            return None
        try:
            data = json.loads(raw)
            values = {f.name: data[f.name] for f in fields(cls)}
        except (ValueError, KeyError, TypeError, RecursionError):  # [[[[... nests past the stack
            return None
        values["partitions"] = tuple(values["partitions"] or ())[:MAX_PARTITIONS]
        if not _typed(values):
            return None
        return cls(**values)


_TEXT = ("worker_id", "stage", "model", "engine", "version", "ec_secret", "settings")
_NUMBERS = ("in_flight", "handled", "started_ms", "announced_ms", "expires_ms")


def _typed(values: dict[str, Any]) -> bool:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    return (
        all(isinstance(values[k], str) and len(values[k]) <= 512 for k in _TEXT)
        and all(whole(values[k]) for k in _NUMBERS)
        and (values["last_handled_ms"] is None or whole(values["last_handled_ms"]))
        and all(isinstance(p, str) and len(p) <= 300 for p in values["partitions"])
    )


def announcement_for(settings: Settings, stage: str, worker_id: str, now_ms: int) -> Announcement:
    """A new worker's announcement (no partitions, nothing handled yet)."""
    uses_model = stage != "results"
    return Announcement(
        worker_id=worker_id,
        stage=stage,
        model=settings.model if uses_model else "",
        engine=engine_of(settings) if uses_model else "",
        version=package_version(),
        ec_secret=secret_fingerprint(settings.secret_bytes()) if uses_model else "",
        settings=settings_fingerprint(settings),
        partitions=(),
        in_flight=0,
        handled=0,
        last_handled_ms=None,
        started_ms=now_ms,
        announced_ms=now_ms,
        expires_ms=now_ms,
    )
