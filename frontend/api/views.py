"""A status record (:class:`schemas.status_record.StatusRecord`) as the API's ``RequestStatus``."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from schemas.status_record import StatusRecord


def iso(ms: float | int | None) -> str | None:
    """Milliseconds since the epoch as ISO-8601 UTC with milliseconds."""
    if ms is None:
        return None
    # isoformat truncates to the millisecond, as the format did; it is C, where strftime's
    # format parsing showed in the API's profile (a status view formats a dozen times).
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def _stage(started: float | None, finished: float | None, ms: float | None = None) -> dict:
    if ms is None and started is not None and finished is not None:
        ms = float(max(0, finished - started))
    return {"started": iso(started), "finished": iso(finished), "ms": ms}


def _items(rec: StatusRecord) -> list[dict[str, Any]]:
    cached = rec.cached
    out = []
    for it in rec.items:
        h = it["mm_hash"]
        hit = h in cached if cached is not None else None
        out.append(
            {
                "modality": it["modality"],
                "mm_hash": h,
                "cache_hit": hit,
                "encoded": bool(hit) or rec.item_encoded(h) or rec.status == "completed",
            }
        )
    return out


def status_view(rec: StatusRecord) -> dict[str, Any]:
    """``RequestStatus`` from a record: stage timings from the stage updates' times."""
    render = rec.render
    prefill_start = rec.stage_time("prefill", "prefilling")
    decode_start = rec.stage_time("prefill", "decoding")
    done = rec.stage_time("prefill", "completed")
    result = None
    if rec.token_ids is not None:
        result = {"token_ids": rec.token_ids, "text": rec.text}
    error = rec.error
    if error is not None:
        error = {k: error.get(k) for k in ("code", "message", "rule", "modality", "item", "field")}
    return {
        "request_id": rec.request_id,
        "status": rec.status,
        "created_at": iso(rec.created_ms),
        "updated_at": iso(rec.updated_ms),
        "stages": {
            "render": _stage(render.get("started_ms"), render.get("finished_ms"), render.get("ms")),
            "encode": _stage(
                rec.stage_time("fanout", "encoding"),
                rec.encode_finished_ms(),
                rec.encode_total_ms(),
            ),
            "prefill": _stage(prefill_start, decode_start or done),
            "decode": _stage(decode_start, done if decode_start is not None else None),
        },
        "items": _items(rec),
        "result": result,
        "error": error,
        "metadata": rec.metadata,
    }
