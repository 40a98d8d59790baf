"""The fleet at one moment: workers, lag, dead letters, requests by status, store memory, and
what keeps the pipeline from serving. One home for what ``epd status``, the admin route, ``/readyz``
and ``/metrics`` report, so they never disagree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from redis.asyncio.cluster import RedisCluster

from runtime.fleet.announcement import secret_fingerprint, settings_fingerprint
from runtime.fleet.board import FleetBoard, FleetRead
from runtime.fleet.offsets import OffsetReader, Offsets
from runtime.fleet.readiness import Expected, fleet_causes, mismatches

if TYPE_CHECKING:
    from runtime.settings import Settings
    from runtime.status import StatusStore
    from schemas.topics import Topics

log = logging.getLogger(__name__)

SHARED_FOR_S = 1.0
"""How long one full snapshot answers every caller of :meth:`FleetProbe.recent`."""


def expected_of(settings: Settings) -> Expected:
    """What workers must agree on with a process of ``settings`` (the API)."""
    return Expected(
        model=settings.model,
        ec_secret=secret_fingerprint(settings.secret_bytes()),
        settings=settings_fingerprint(settings),
    )


def expected_as_configured(settings: Settings) -> Expected:
    """Only what ``settings`` were given explicitly (a tool such as ``epd status``, run in a
    shell that may lack the secret or the model): the rest the workers must agree on among
    themselves."""
    given = settings.model_fields_set
    full = expected_of(settings)
    return Expected(
        model=full.model if "model" in given else None,
        ec_secret=full.ec_secret if settings.ec_secret is not None else None,
        settings=full.settings if {"ec_namespace", "decode_stage"} <= given else None,
    )


@dataclass(frozen=True)
class StoreMemory:
    """The embedding store's Redis memory (summed over a cluster's masters)."""

    used_bytes: int
    max_bytes: int
    """``maxmemory`` (0: no limit set)."""


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything the fleet view reports, taken at ``taken_ms``."""

    taken_ms: int
    fleet: FleetRead
    causes: list[str]
    """Why the pipeline cannot serve now (empty: it can)."""
    offsets: Offsets | None
    requests: dict[str, int]
    """Unfinished requests by status."""
    store: StoreMemory | None
    errors: dict[str, str] = field(default_factory=dict)
    """Parts that could not be read (``kafka``, ``redis``, ``store``) and why."""
    mismatched: list[dict[str, str]] = field(default_factory=list)
    """One entry per (live worker, reason) that disagrees with this process."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (``epd status --json``, ``GET /v1/admin/fleet``)."""
        offsets = self.offsets
        return {
            "taken_ms": self.taken_ms,
            "ready": not self.causes,
            "causes": self.causes,
            "workers": [a.to_dict() for a in self.fleet.live],
            "gone": [a.to_dict() for a in self.fleet.gone],
            "mismatched": self.mismatched,
            "lag": [asdict(p) for p in offsets.lag] if offsets else None,
            "dlq_records": offsets.dlq_records if offsets else None,
            "requests": self.requests,
            "store": asdict(self.store) if self.store else None,
            "errors": self.errors,
        }


class FleetProbe:
    """Takes :class:`FleetSnapshot` for the pipeline of ``settings`` (its board, broker, Redis)."""

    def __init__(
        self,
        settings: Settings,
        topics: Topics,
        status: StatusStore,
        expected: Expected | None = None,
    ) -> None:
        """``expected``: what workers must agree with (default: :func:`expected_of` the
        settings)."""
        self.settings = settings
        self.status = status
        self.board = FleetBoard(status.client, status.keys)
        self.offsets = OffsetReader(settings, topics)
        self.expected = expected or expected_of(settings)
        self.clock = time.monotonic
        self._shared: tuple[float, FleetSnapshot] | None = None
        self._shared_lock = asyncio.Lock()

    async def fleet(self, now_ms: int) -> tuple[FleetRead, list[str]]:
        """The board and the causes readiness reports (raises what Redis raised)."""
        fleet = await self.board.read(now_ms)
        required = self.settings.required_stages
        return fleet, fleet_causes(fleet, self.expected, required, now_ms)

    async def recent(self, max_age_s: float = SHARED_FOR_S) -> FleetSnapshot:
        """A full snapshot no older than ``max_age_s``: callers at the same moment (scrapes of
        several Prometheus servers, a scraper hammering ``/metrics``) share one read of the
        broker and Redis instead of queueing their own behind the offsets' lock."""
        async with self._shared_lock:
            last = self._shared
            if last is not None and self.clock() - last[0] <= max_age_s:
                return last[1]
            snap = await self.snapshot()
            self._shared = (self.clock(), snap)
            return snap

    async def snapshot(self, *, kafka: bool = True) -> FleetSnapshot:
        """Every part that can be read; a part that cannot is named in ``errors``."""
        now_ms = int(time.time() * 1000)
        errors: dict[str, str] = {}
        fleet, causes = FleetRead((), ()), list[str]()
        requests: dict[str, int] = {}
        try:
            fleet, causes = await self.fleet(now_ms)
            requests = await self.status.in_flight_by_status()
        except Exception as exc:
            errors["redis"] = _words(exc)
            causes = [f"Redis cannot be read: {errors['redis']}"]
        offsets = None
        if kafka:
            try:
                offsets = await self.offsets.read()
            except Exception as exc:
                errors["kafka"] = _words(exc)
        store = None
        try:
            store = await self._store_memory()
        except Exception as exc:
            errors["store"] = _words(exc)
        odd = [
            {"worker_id": a.worker_id, "stage": a.stage, "reason": reason, "cause": cause}
            for a in fleet.live
            for reason, cause in mismatches(a, self.expected)
        ]
        return FleetSnapshot(now_ms, fleet, causes, offsets, requests, store, errors, odd)

    async def _store_memory(self) -> StoreMemory | None:
        """The store's memory when the store is the status Redis (the default); None when the
        store lives elsewhere (its own Redis or shared memory)."""
        if self.settings.store_url and self.settings.store_url != self.settings.redis_url:
            return None
        client = self.status.client
        if isinstance(client, RedisCluster):
            per_node: dict[str, Any] = await client.info(
                "memory", target_nodes=RedisCluster.PRIMARIES
            )
            infos = list(per_node.values())
        else:
            infos = [await client.info("memory")]
        limits = [int(i.get("maxmemory", 0)) for i in infos]
        return StoreMemory(
            used_bytes=sum(int(i.get("used_memory", 0)) for i in infos),
            # One master without a limit leaves the whole store without one.
            max_bytes=0 if not all(limits) else sum(limits),
        )

    async def close(self) -> None:
        """Close the broker clients."""
        await self.offsets.close()


def _words(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
