"""Request status records in Redis: folded from ResultEvents, deduplicated, never regressing."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from schemas.types import TERMINAL_STATUSES, ResultEvent, now_ms

_RANK = {"queued": 0, "encoding": 1, "prefilling": 2}


def _rank(status: str) -> int:
    return 3 if status in TERMINAL_STATUSES else _RANK.get(status, 0)


def fold(record: dict[str, Any] | None, ev: ResultEvent) -> dict[str, Any] | None:
    """The record after applying one ResultEvent, or None when it changes nothing.

    Rules: the status only moves forward (queued < encoding < prefilling < terminal) and the
    first terminal status wins, so a redelivered or late event cannot undo an outcome. Stage
    timings and info are merged; a (stage, status) pair already seen is a duplicate.
    """
    rec = record or {
        "request_id": ev.request_id,
        "status": "queued",
        "stages": {},
        "timings": {},
        "info": {},
        "token_ids": None,
        "text": None,
        "error": None,
        "created_ms": ev.created_ms,
    }
    seen_key = f"{ev.stage}:{ev.status}"
    if seen_key in rec["stages"]:
        return None
    terminal = rec["status"] in TERMINAL_STATUSES
    rec["stages"][seen_key] = ev.created_ms
    rec["timings"].update(ev.timings)
    rec["info"].update(ev.info)
    if not terminal and _rank(ev.status) >= _rank(rec["status"]):
        rec["status"] = ev.status
        if ev.status in TERMINAL_STATUSES:
            rec["finished_ms"] = ev.created_ms
            rec["token_ids"] = ev.token_ids
            rec["text"] = ev.text
            rec["error"] = asdict(ev.error) if ev.error else None
    rec["updated_ms"] = now_ms()
    return rec


class StatusStore:
    """Status records under ``{prefix}:status:{request_id}`` with a TTL."""

    def __init__(self, client: aioredis.Redis, *, prefix: str = "epd", ttl_s: int = 3600) -> None:
        self.client = client
        self.prefix = prefix
        self.ttl_s = ttl_s

    def key(self, request_id: str) -> str:
        return f"{self.prefix}:status:{request_id}"

    async def get(self, request_id: str) -> dict[str, Any] | None:
        """The status record of a request, or None when unknown or expired."""
        raw = await self.client.get(self.key(request_id))
        return json.loads(raw) if raw else None

    async def apply(self, ev: ResultEvent) -> bool:
        """Fold one ResultEvent into its record atomically; False when it was a duplicate."""
        key = self.key(ev.request_id)
        async with self.client.pipeline(transaction=True) as pipe:
            while True:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    rec = fold(json.loads(raw) if raw else None, ev)
                    if rec is None:
                        await pipe.unwatch()
                        return False
                    pipe.multi()
                    pipe.set(key, json.dumps(rec), ex=self.ttl_s)
                    await pipe.execute()
                    return True
                except WatchError:
                    continue  # another writer changed the record; fold again on the new value
