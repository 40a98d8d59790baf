"""Status folding (pure) and the Redis-backed status store (real Redis)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from runtime.status_store import StatusStore, fold
from schemas.types import ErrorInfo, ResultEvent


def test_status_moves_forward_only() -> None:
    rec = fold(None, ResultEvent("r", "fanout", "encoding"))
    assert rec is not None and rec["status"] == "encoding"
    rec = fold(rec, ResultEvent("r", "api", "queued"))  # late, lower rank
    assert rec is not None and rec["status"] == "encoding"
    rec = fold(rec, ResultEvent("r", "prefill", "prefilling", timings={"wait": 3.0}))
    assert rec is not None and rec["status"] == "prefilling" and rec["timings"]["wait"] == 3.0


def test_first_terminal_wins_and_duplicates_are_dropped() -> None:
    done = ResultEvent("r", "prefill", "completed", token_ids=[1, 2], text="ab")
    rec = fold(None, done)
    assert rec is not None and rec["status"] == "completed" and rec["token_ids"] == [1, 2]
    assert fold(rec, done) is None  # redelivery
    err = ErrorInfo("failed", "late failure")
    rec2 = fold(rec, ResultEvent("r", "encode", "failed", error=err))
    assert rec2 is not None and rec2["status"] == "completed" and rec2["error"] is None


def test_rejection_keeps_rule_and_item() -> None:
    err = ErrorInfo("rejected", "no ec entry", "ec-transfer-required", "image", 1, None)
    rec = fold(None, ResultEvent("r", "prefill", "rejected", error=err))
    assert rec is not None
    assert rec["error"]["rule"] == "ec-transfer-required" and rec["error"]["item"] == 1


@pytest.fixture
async def store():
    client = aioredis.Redis.from_url("redis://127.0.0.1:6379/13")
    prefix = f"t-{uuid.uuid4().hex[:8]}"
    yield StatusStore(client, prefix=prefix, ttl_s=60)
    keys = [k async for k in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_store_applies_and_dedupes(store: StatusStore) -> None:
    assert await store.get("r1") is None
    assert await store.apply(ResultEvent("r1", "api", "queued"))
    assert await store.apply(ResultEvent("r1", "prefill", "completed", token_ids=[7]))
    assert not await store.apply(ResultEvent("r1", "prefill", "completed", token_ids=[7]))
    rec = await store.get("r1")
    assert rec is not None and rec["status"] == "completed" and rec["token_ids"] == [7]
    assert 0 < await store.client.ttl(store.key("r1")) <= 60


async def test_concurrent_writers_lose_nothing(store: StatusStore) -> None:
    events = [
        ResultEvent("r2", f"stage{i}", "encoding", timings={f"t{i}": float(i)}) for i in range(20)
    ]
    await asyncio.gather(*(store.apply(e) for e in events))
    rec = await store.get("r2")
    assert rec is not None and len(rec["timings"]) == 20 and len(rec["stages"]) == 20


def test_encoded_events_mark_each_item_of_a_request() -> None:
    """Each EncodedEvent lands once per item: hits and misses both show in the record."""
    from consumers.results import encoded_update
    from schemas.types import EncodedEvent

    a = EncodedEvent("a" * 64, "r", "tiny", "redis://", "ec:fp:a", "float32", [4, 8], encode_ms=7)
    b = EncodedEvent("b" * 64, "r", "tiny", "redis://", "ec:fp:b", "float32", [], cache_hit=True)
    rec = fold(fold(None, ResultEvent("r", "fanout", "encoding")), encoded_update(a))
    rec = fold(rec, encoded_update(b))
    assert rec is not None
    assert rec["info"] == {"encoded." + "a" * 12: "encoded", "encoded." + "b" * 12: "cache_hit"}
    assert rec["timings"] == {"encode." + "a" * 12: 7.0}
    assert fold(rec, encoded_update(a)) is None  # a redelivered EncodedEvent changes nothing
