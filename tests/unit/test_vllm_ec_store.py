"""The EC connector's store side, vLLM-free, against real stores (Redis, a 3-master Redis
Cluster, shm): the private loop thread, the consumer's gate, loads and saves, and both
directions of compatibility with our own workers' code (our encode side's
``store_outputs`` is loaded by the connector; the connector's save is read by our prefill
side's ``fetch_outputs``)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis.asyncio as aioredis
import torch

from epd_vllm_ec.entries import item_key, signed_entry, verify_entry
from epd_vllm_ec.scheduler_side import ConsumerGate, LoadItem, producer_entries, wall_ms
from epd_vllm_ec.settings import ConnectorSettings, connector_settings
from epd_vllm_ec.store_thread import StoreThread
from epd_vllm_ec.worker_side import ECLoadError, load_items, save_item
from gpu_workers.entries import fetch_outputs, store_outputs
from runtime.stores import StoreTimeout, open_store
from schemas.families import DEEPSTACK, EMBEDS, family
from schemas.signing import make_ec_transfer

REDIS_BASE = "redis://127.0.0.1:6379/14"
SECRET = "s3cret-for-ec-store-tests"
FP = "tiny-fp"


@dataclass
class Feature:
    """The fields of vLLM's ``MultiModalFeatureSpec`` the gate reads."""

    identifier: str
    data: Any = None


@dataclass
class Req:
    """The fields of vLLM's ``Request`` the gate reads."""

    request_id: str
    mm_features: list[Feature]
    ec_transfer_params: dict[str, Any] | None = field(default=None)


@pytest.fixture(params=["redis", "cluster", "shm"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str]:
    tag = uuid.uuid4().hex[:12]
    kind = request.param
    cluster = request.getfixturevalue("redis_cluster") if kind == "cluster" else None
    if kind == "redis":
        url = f"{REDIS_BASE}?key_prefix=test-{tag}:"
    elif cluster is not None:
        url = f"{cluster.url}?key_prefix=test-{tag}:"
    else:
        url = f"shm://epd-test-{tag}"
    yield url
    if cluster is not None:
        cluster.delete(f"test-{tag}:*")
    elif kind == "shm":
        shutil.rmtree(f"/dev/shm/epd-test-{tag}", ignore_errors=True)
    else:
        asyncio.run(_drop_redis_keys(f"test-{tag}:*"))


async def _drop_redis_keys(pattern: str) -> None:
    client = aioredis.Redis.from_url(REDIS_BASE)
    keys = [k async for k in client.scan_iter(match=pattern)]
    if keys:
        await client.delete(*keys)
    await client.aclose()


@pytest.fixture
def ec(store_url: str) -> Iterator[tuple[ConnectorSettings, StoreThread]]:
    settings = connector_settings(
        {"store_url": store_url, "model_fingerprint": FP, "ttl_s": 60},
        {"EPD_EC_SECRET": SECRET},
    )
    thread = StoreThread(store_url)
    yield settings, thread
    thread.close()


def test_the_store_thread_serves_synchronous_callers_and_closes_once(store_url: str) -> None:
    thread = StoreThread(store_url)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    async def put(store: Any) -> None:
        await store.put("a", t, 30)

    async def get(store: Any) -> torch.Tensor:
        return await store.get("a")

    async def stall(store: Any) -> None:
        await asyncio.sleep(30)

    thread.call(put, 5)
    assert torch.equal(thread.call(get, 5), t)
    # A call past its bound is cancelled and reported; the thread serves the next one.
    started = time.monotonic()
    with pytest.raises(StoreTimeout):
        thread.call(stall, 0.2)
    assert time.monotonic() - started < 5
    assert torch.equal(thread.call(get, 5), t)
    thread.close()
    thread.close()
    with pytest.raises(RuntimeError, match="closed"):
        thread.call(get, 5)


async def test_a_connector_save_is_read_by_our_prefill_workers_fetch(
    ec: tuple[ConnectorSettings, StoreThread],
) -> None:
    settings, thread = ec
    plain = torch.randn(6, 8).to(torch.bfloat16)
    embeds, deepstack = torch.randn(6, 8), torch.randn(3, 6, 8)
    save_item(thread, settings, item_key(settings, "p"), plain, 0)
    save_item(thread, settings, item_key(settings, "d"), torch.cat([embeds, *deepstack], 1), 3)
    async with open_store(thread.url) as store:
        [got] = await fetch_outputs(store, [item_key(settings, "p")], family("qwen2_vl"))
        assert got[EMBEDS].dtype == torch.bfloat16 and torch.equal(got[EMBEDS], plain)
        [got] = await fetch_outputs(store, [item_key(settings, "d")], family("qwen3_vl"))
        assert torch.equal(got[EMBEDS], embeds) and torch.equal(got[DEEPSTACK], deepstack)
    # The producer's entries verify under the safety gate's checks (as our split's do).
    entries = producer_entries(settings, thread, ["p", "d", "never-saved"], wall_ms())
    assert sorted(entries) == ["d", "p"]
    for h, entry in entries.items():
        assert verify_entry(entries, h, settings, thread.url, wall_ms()).key == entry["key"]


async def test_our_encode_workers_entry_is_loaded_by_the_connector(
    ec: tuple[ConnectorSettings, StoreThread],
) -> None:
    settings, thread = ec
    embeds, deepstack = torch.randn(5, 4), torch.randn(2, 5, 4)
    keys = {"q2": f"ec:{FP}:content-q2", "q3": f"ec:{FP}:content-q3"}
    async with open_store(thread.url) as store:
        await store_outputs(store, keys["q2"], {EMBEDS: embeds}, family("qwen2_vl"), 60)
        outputs = {EMBEDS: embeds, DEEPSTACK: deepstack}
        await store_outputs(store, keys["q3"], outputs, family("qwen3_vl"), 60)
    # Signed as `epd vllm split` signs a prefill body's entries (bound to no request).
    params = {h: _split_entry(h, thread.url, k) for h, k in keys.items()}
    gate = ConsumerGate(settings, thread)
    assert gate.admit(Req("r1", [Feature("q2"), Feature("q3")], params))
    assert gate.trusted("q2") and gate.trusted("q3")
    gate.plan_load("q2", 5)
    gate.plan_load("q3", 5)
    cache: dict[str, torch.Tensor] = {}
    loaded = load_items(thread, settings, gate.take_loads(), cache, device="cpu", dtype=None)
    assert sorted(loaded) == ["q2", "q3"] and gate.take_loads() == []
    assert torch.equal(cache["q2"], embeds)
    assert torch.equal(cache["q3"], torch.cat([embeds, *deepstack], dim=1))
    gate.finished("r1")
    assert not gate.trusted("q2")


def _split_entry(mm_hash: str, store: str, key: str) -> dict[str, Any]:
    ec = make_ec_transfer(
        mm_hash=mm_hash,
        store=store,
        key=key,
        expires_ms=wall_ms() + 60_000,
        secret=SECRET.encode(),
    )
    return {
        "mm_hash": mm_hash,
        "store": store,
        "key": key,
        "expires_ms": ec.expires_ms,
        "signature": ec.signature,
    }


def test_the_gate_refuses_forged_foreign_and_absent_entries(
    ec: tuple[ConnectorSettings, StoreThread],
) -> None:
    settings, thread = ec
    save_item(thread, settings, item_key(settings, "h"), torch.ones(2, 2), 0)
    good = signed_entry(settings, thread.url, "h", wall_ms() + 60_000)
    cases = {
        "forged": {**good, "signature": "f" * 64},
        "foreign": signed_entry(settings, "redis://elsewhere:6379/0", "h", wall_ms() + 60_000),
        "absent": signed_entry(settings, thread.url, "gone", wall_ms() + 60_000),
    }
    gate = ConsumerGate(settings, thread)
    for name, entry in cases.items():
        mm_hash = entry["mm_hash"]
        # With the media at hand the item is encoded locally: admitted, not trusted.
        assert gate.admit(Req(f"{name}-media", [Feature(mm_hash, data=b"px")], {mm_hash: entry}))
        # Without it the request cannot be served: failed once, through take_unavailable.
        assert not gate.admit(Req(f"{name}-bare", [Feature(mm_hash)], {mm_hash: entry}))
        assert not gate.trusted(mm_hash)
        assert gate.take_unavailable() == {f"{name}-bare"}
        assert gate.take_unavailable() == set()
    gate.plan_load("h", 2)
    assert gate.take_loads() == []
    # The genuine entry is trusted; no entry at all is left to vLLM (not a refusal).
    assert gate.admit(Req("ok", [Feature("h"), Feature("x")], {"h": good}))
    assert gate.trusted("h") and not gate.trusted("x")


def test_a_lost_or_misfit_item_fails_the_load_loudly(
    ec: tuple[ConnectorSettings, StoreThread],
) -> None:
    settings, thread = ec
    key = item_key(settings, "h")
    save_item(thread, settings, key, torch.ones(3, 2), 0)
    cache: dict[str, torch.Tensor] = {}
    with pytest.raises(ECLoadError, match="needs 4"):
        load_items(thread, settings, [LoadItem("h", key, 4)], cache, device="cpu", dtype=None)
    with pytest.raises(ECLoadError, match="missing"):
        load_items(
            thread,
            settings,
            [LoadItem("g", item_key(settings, "g"), 3)],
            cache,
            device="cpu",
            dtype=None,
        )
    assert cache == {}
    load_items(thread, settings, [LoadItem("h", key, 3)], cache, device="cpu", dtype=torch.float16)
    assert cache["h"].dtype == torch.float16
    with pytest.raises(ValueError, match="max_item_bytes"):
        small = connector_settings(
            {"store_url": thread.url, "model_fingerprint": FP, "max_item_bytes": 8},
            {"EPD_EC_SECRET": SECRET},
        )
        save_item(thread, small, key, torch.ones(3, 2), 0)


def test_a_store_that_cannot_open_leaves_no_thread_behind() -> None:
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ValueError, match="unknown embedding store scheme"):
        StoreThread("nope://x", name="epd-ec-test-unopened")
    assert "epd-ec-test-unopened" not in {t.name for t in threading.enumerate()} - before
