"""A request's status record and its fold (pure: no I/O; the Redis store is runtime.status).

The record is folded from ResultEvents: the status only moves forward, the first terminal status
wins, stage timings and info are merged, and a redelivered update changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from schemas.types import TERMINAL_STATUSES, EncodedEvent, ResultEvent, now_ms

_RANK = {"queued": 0, "encoding": 1, "prefilling": 2, "decoding": 3}
_TERMINAL_RANK = 4


def _rank(status: str) -> int:
    return _TERMINAL_RANK if status in TERMINAL_STATUSES else _RANK.get(status, 0)


def fold(record: dict[str, Any] | None, ev: ResultEvent) -> dict[str, Any] | None:
    """The record after applying one ResultEvent, or None when it changes nothing.

    Rules: the status only moves forward (queued < encoding < prefilling < decoding <
    terminal) and the first terminal status wins, so a redelivered or late event cannot undo
    an outcome (a ``completed`` after a ``cancelled`` changes nothing). Stage timings and info
    are merged; a (stage, status) pair already seen, with nothing new in its timings and
    info, is a duplicate (``stages`` keeps the first time of a pair, ``stages_last`` the last).
    """
    rec = record or new_record(ev.request_id, ev.created_ms)
    seen_key = f"{ev.stage}:{ev.status}"
    if seen_key in rec["stages"]:
        # A redelivery brings nothing new. Another item's update of the same stage (a second
        # image's "encode:encoding") does: its timings and info are kept.
        if all(rec["timings"].get(k) == v for k, v in ev.timings.items()) and all(
            rec["info"].get(k) == v for k, v in ev.info.items()
        ):
            return None
        rec.setdefault("stages_last", {})[seen_key] = ev.created_ms
    else:
        rec["stages"][seen_key] = ev.created_ms
    terminal = rec["status"] in TERMINAL_STATUSES
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


def encoded_update(ev: EncodedEvent, *, hop_ms: float | None = None) -> ResultEvent:
    """The status update an EncodedEvent stands for.

    The stage name carries the item's hash, so each item is recorded once (a redelivered
    EncodedEvent is a duplicate) while different items of one request all land. ``hop_ms``: the
    broker hop the encode event came through, which the encode worker adds to its own write of
    the mark (the EncodedEvent does not carry it).
    """
    short = ev.mm_hash[:12]
    info = {f"encoded.{short}": "cache_hit" if ev.cache_hit else "encoded"}
    timings = {} if ev.cache_hit else {f"encode.{short}": ev.encode_ms}
    if hop_ms is not None:
        timings[f"encode_hop.{short}"] = hop_ms
    if not ev.ok:
        info = {f"encode_failed.{short}": ev.error.code if ev.error else "error"}
        timings = {}
    return ResultEvent(
        request_id=ev.request_id,
        stage=f"encode.{short}",
        status="encoding",
        timings=timings,
        info=info,
        worker="",
        created_ms=ev.created_ms,
    )


def new_record(request_id: str, created_ms: int | None = None) -> dict[str, Any]:
    """An empty ``queued`` record."""
    return {
        "request_id": request_id,
        "status": "queued",
        "stages": {},
        "timings": {},
        "info": {},
        "token_ids": None,
        "text": None,
        "error": None,
        "created_ms": created_ms if created_ms is not None else now_ms(),
    }


def event_entry(rec: dict[str, Any], stage: str) -> str:
    """The JSON of one status change as it is kept in the request's event stream."""
    entry: dict[str, Any] = {
        "request_id": rec["request_id"],
        "status": rec["status"],
        "stage": stage,
        "at_ms": rec["updated_ms"],
    }
    if rec["status"] in TERMINAL_STATUSES:
        entry["token_ids"] = rec["token_ids"]
        entry["text"] = rec["text"]
        entry["error"] = rec["error"]
    return json.dumps(entry)


def encoded_items(info: dict[str, Any]) -> frozenset[str]:
    """The short hashes a record's ``info`` marks ``encoded`` or ``cache_hit``."""
    return frozenset(
        k.removeprefix("encoded.")
        for k, v in info.items()
        if k.startswith("encoded.") and v in ("encoded", "cache_hit")
    )
