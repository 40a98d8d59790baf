"""The fleet view on a real broker and Redis, with real worker processes: workers announce
themselves, ``/readyz`` says what keeps the pipeline from serving (a stage without a live
worker, a worker with another EC secret or another model), ``/metrics`` exports the fleet,
``GET /v1/admin/fleet`` is admin-scoped, and ``epd status`` prints the same snapshot."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from epd.local_pipeline import LocalRun, WorkerProcesses, local_pipeline, worker_env
from frontend.api.app import create_app
from runtime.settings import Settings
from tests.integration.api_stack import free_port

pytestmark = [pytest.mark.integration]

LIGHT = ("results", "router")
"""Stages that load no weights: quick to start, and enough to show every rule."""


@pytest.fixture(scope="module")
async def run(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LocalRun]:
    log_dir = tmp_path_factory.mktemp("fleet-logs")
    fast = settings.model_copy(
        update={
            "fleet_announce_s": 0.5,
            "fleet_ttl_s": 3.0,
            "heartbeat_file": log_dir / "heartbeat",
        }
    )
    async with local_pipeline(fast, spawn_workers=True, log_dir=log_dir, kinds=LIGHT) as r:
        yield r


async def _api(settings: Settings, **update: Any) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(settings.model_copy(update=update))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:

            async def connected() -> bool:
                return bool((await client.get("/readyz")).json()["checks"]["kafka"] == "ok")

            assert await _until(connected), "the API did not connect to the broker"
            yield client


async def _until(check: Any, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = await check()
        if got or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.2)


async def _workers_check(api: httpx.AsyncClient) -> tuple[int, str]:
    r = await api.get("/readyz")
    return r.status_code, r.json()["checks"]["workers"]


async def test_ready_with_the_required_stages_live_and_503_naming_a_missing_one(
    run: LocalRun,
) -> None:
    async for api in _api(run.settings, ready_stages="router,results"):
        code, words = await _workers_check(api)
        assert (code, words) == (200, "ok"), words
    async for api in _api(run.settings, ready_stages="router,prefill,results"):
        code, words = await _workers_check(api)
        assert code == 503
        assert words == "no live prefill worker (none has announced itself)"


async def test_a_worker_with_another_secret_or_model_makes_the_api_unready_until_it_stops(
    run: LocalRun, tmp_path: Path
) -> None:
    odd = [
        run.settings.model_copy(update={"ec_secret": SecretStr("another-secret-" + "x" * 32)}),
        run.settings.model_copy(update={"model": "instant"}),
    ]
    async for api in _api(run.settings, ready_stages="router,results"):
        for n, settings in enumerate(odd):
            with WorkerProcesses(worker_env(settings), tmp_path / str(n), ["router"]) as extra:
                await extra.wait_ready()

                async def told(api: httpx.AsyncClient = api) -> tuple[int, str] | None:
                    code, words = await _workers_check(api)
                    return (code, words) if code == 503 else None

                code, words = await _until(told)
                assert code == 503, words
                if n == 0:
                    assert "signs with another EC secret" in words, words
                    assert "ec-signature" in words
                else:
                    assert "serves model 'instant'; the API serves" in words, words
                metrics = (await api.get("/metrics")).text
                reason = "ec_secret" if n == 0 else "model"
                assert (
                    f'epd_fleet_mismatched_workers{{reason="{reason}",stage="router"}} 1.0'
                    in metrics
                )
            # A clean stop withdraws the announcement: ready again at once.
            assert await _workers_check(api) == (200, "ok")


async def test_workers_touch_their_heartbeat_file_while_they_run(run: LocalRun) -> None:
    beat = run.settings.heartbeat_file
    assert beat is not None
    first = beat.stat().st_mtime
    await asyncio.sleep(1.5)  # three beats
    assert beat.stat().st_mtime > first
    assert time.time() - beat.stat().st_mtime < 1.5


async def test_a_worker_serves_its_own_series_on_the_metrics_port(
    run: LocalRun, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **worker_env(run.settings),
        "EPD_METRICS_PORT": str(port),
        "EPD_METRICS_HOST": "127.0.0.1",
    }
    with WorkerProcesses(env, tmp_path, ["router"]) as extra:
        await extra.wait_ready()
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
    group = run.settings.topic_prefix + "-router"
    assert f'epd_consumer_in_flight{{group="{group}"}}' in text


async def test_metrics_export_workers_lag_and_dead_letters(run: LocalRun) -> None:
    async for api in _api(run.settings, ready_stages="router,results"):
        text = (await api.get("/metrics")).text
    prefix = run.settings.topic_prefix
    assert 'epd_fleet_workers{stage="router"} 1.0' in text
    assert 'epd_fleet_workers{stage="prefill"} 0.0' in text
    # Lag of a group with no member at all is still measured (from the broker's offsets).
    assert (
        f'epd_group_lag{{group="{prefix}-prefill",partition="0",topic="{prefix}.prefill"}}' in text
    )
    assert f'epd_dlq_records{{topic="{prefix}.dlq"}}' in text
    assert "epd_store_used_bytes" in text


async def test_the_admin_route_is_for_admins_only(run: LocalRun) -> None:
    async for api in _api(run.settings, api_tokens=None, admin_tokens=None):
        r = await api.get("/v1/admin/fleet")
        assert r.status_code == 200  # an open API without admin tokens: open
        body = r.json()
        assert {w["stage"] for w in body["workers"]} == set(LIGHT)
        assert body["dlq_records"] == {f"{run.settings.topic_prefix}.dlq": 0}
    tenants = SecretStr("tenant-token=alice")
    async for api in _api(run.settings, api_tokens=tenants, admin_tokens=None):
        r = await api.get("/v1/admin/fleet", headers={"Authorization": "Bearer tenant-token"})
        assert r.status_code == 403 and r.json()["error"]["rule"] == "auth.admin"
    admins = SecretStr("ops-token=ops")
    async for api in _api(run.settings, api_tokens=tenants, admin_tokens=admins):
        assert (await api.get("/v1/admin/fleet")).status_code == 401
        r = await api.get("/v1/admin/fleet", headers={"Authorization": "Bearer tenant-token"})
        assert r.status_code == 403
        r = await api.get("/v1/admin/fleet", headers={"Authorization": "Bearer ops-token"})
        assert r.status_code == 200 and r.json()["workers"]


def _epd_status(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **worker_env(settings)}
    return subprocess.run(
        [sys.executable, "-m", "epd.cli", "status", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_epd_status_prints_the_fleet_and_exits_by_readiness(run: LocalRun) -> None:
    ok = run.settings.model_copy(update={"ready_stages": "router,results"})
    done = await asyncio.to_thread(_epd_status, ok, "--json")
    assert done.returncode == 0, done.stderr
    snap = json.loads(done.stdout)
    router = next(w for w in snap["workers"] if w["stage"] == "router")
    assert router["partitions"] and all(":" in p for p in router["partitions"])
    groups = {p["group"] for p in snap["lag"]}
    assert f"{run.settings.topic_prefix}-encode" in groups
    text = await asyncio.to_thread(_epd_status, run.settings)
    print(f"\nepd status:\n{text.stdout}")
    assert text.returncode == 1, text.stdout  # no encode / prefill worker in this run
    assert text.stdout.startswith("NOT READY")
    assert "no live encode worker" in text.stdout and "router@" in text.stdout
