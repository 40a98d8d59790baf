"""``/healthz``, ``/readyz`` and ``/metrics``: what operators and orchestrators ask."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from frontend.api.deps import State
from frontend.api.protocol import Health
from frontend.api.state import ApiState
from runtime.fleet.export import export_fleet
from schemas.statuses import ACTIVE_STATUSES

router = APIRouter(tags=["ops"])
REDIS_PING_S = 2.0
METADATA_S = 3.0


def failure(exc: BaseException, timeout_s: float) -> str:
    """A failed check in words: a timeout says so (its str() is empty), others name their type."""
    if isinstance(exc, TimeoutError):
        return f"error: no answer within {timeout_s:g} s"
    text = str(exc)
    return f"error: {type(exc).__name__}: {text}" if text else f"error: {type(exc).__name__}"


@router.get("/healthz", response_model=Health, summary="process is up")
async def healthz() -> dict[str, Any]:
    return {"status": "ok", "checks": {}}


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "a dependency is not ready"}},
    summary="Redis and the broker reachable, topics present",
)
async def readyz(st: State) -> JSONResponse:
    checks: dict[str, Any] = {}
    try:
        await asyncio.wait_for(st.redis.ping(), REDIS_PING_S)
        checks["redis"] = "ok"
    except Exception as e:
        checks["redis"] = failure(e, REDIS_PING_S)
    checks["status_notifications"] = "ok" if st.notifier.healthy else "not subscribed"
    if not st.kafka_ready.is_set() or st.admin is None:
        checks["kafka"] = "not connected"
    else:
        try:
            listed = await asyncio.wait_for(st.admin.list_topics(), METADATA_S)
            missing = sorted(set(st.topics.all()) - set(listed))
            checks["kafka"] = "ok" if not missing else f"missing topics: {missing}"
        except Exception as e:
            checks["kafka"] = failure(e, METADATA_S)
    checks["workers"] = await _workers(st)
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ready" if ok else "not ready", "checks": checks},
        status_code=200 if ok else 503,
    )


async def _workers(st: ApiState) -> str:
    """``ok``, or why the fleet cannot serve (a required stage without a live worker, a worker
    with another EC secret, model or shared settings: ``runtime.fleet.readiness``)."""
    try:
        _, causes = await asyncio.wait_for(st.fleet.fleet(int(time.time() * 1000)), REDIS_PING_S)
    except Exception as e:
        return failure(e, REDIS_PING_S)
    return "ok" if not causes else "; ".join(causes)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def prometheus(request: Request, st: State) -> Response:
    metrics = request.app.state.metrics
    # The snapshot reads each part on its own (a part that fails keeps its series' last value)
    # and carries the unfinished requests by status, so Redis is asked for them once.
    snap = await st.fleet.recent()
    export_fleet(metrics.fleet, snap)
    if "redis" not in snap.errors:
        for status in ACTIVE_STATUSES:
            metrics.by_status.labels(status).set(snap.requests.get(status, 0))
    with contextlib.suppress(Exception):
        metrics.in_flight.set(await st.status.in_flight())
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
