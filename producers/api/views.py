"""A status record (runtime.status) as the API's ``RequestStatus`` JSON."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from schemas.status_record import encoded_items

ENCODE_MARK = "encode."
"""Stage names of the per-item encode marks (``encode.<hash12>``, from ``encoded_update``)."""


def iso(ms: float | int | None) -> str | None:
    """Milliseconds since the epoch as ISO-8601 UTC with milliseconds."""
    if ms is None:
        return None
    dt = datetime.fromtimestamp(ms / 1000, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{dt.microsecond // 1000:03d}Z"


def _stage(started: float | None, finished: float | None, ms: float | None = None) -> dict:
    if ms is None and started is not None and finished is not None:
        ms = float(max(0, finished - started))
    return {"started": iso(started), "finished": iso(finished), "ms": ms}


def _encode_finished(stages: dict[str, float], last: dict[str, float]) -> float | None:
    """When the last item's encode mark landed: each item's stage writes its own mark
    (``encode.<hash12>:encoding``); a stage that reported as a whole wrote ``encode:encoding``."""
    marks = [
        t
        for seen in (stages, last)
        for key, t in seen.items()
        if key.endswith(":encoding") and (key.startswith(ENCODE_MARK) or key == "encode:encoding")
    ]
    return max(marks) if marks else None


def status_view(rec: dict[str, Any]) -> dict[str, Any]:
    """``RequestStatus`` from a record: stage timings from the stage updates' times."""
    stages: dict[str, float] = rec.get("stages", {})
    last: dict[str, float] = rec.get("stages_last", {})
    timings: dict[str, float] = rec.get("timings", {})
    info: dict[str, str] = rec.get("info", {})
    status = rec["status"]
    render = rec.get("render") or {}
    encode_ms = [v for k, v in timings.items() if k.startswith(ENCODE_MARK)]
    enc_done = _encode_finished(stages, last)
    prefill_start = stages.get("prefill:prefilling")
    decode_start = stages.get("prefill:decoding")
    done = stages.get("prefill:completed")
    cached = set(rec.get("cached") or [])
    encoded = encoded_items(info)
    items = []
    for it in rec.get("items") or []:
        h = it["mm_hash"]
        hit = h in cached if rec.get("cached") is not None else None
        items.append(
            {
                "modality": it["modality"],
                "mm_hash": h,
                "cache_hit": hit,
                "encoded": bool(hit) or h[:12] in encoded or status == "completed",
            }
        )
    result = None
    if rec.get("token_ids") is not None:
        result = {"token_ids": rec["token_ids"], "text": rec.get("text")}
    error = rec.get("error")
    if error is not None:
        error = {k: error.get(k) for k in ("code", "message", "rule", "modality", "item", "field")}
    return {
        "request_id": rec["request_id"],
        "status": status,
        "created_at": iso(rec["created_ms"]),
        "updated_at": iso(rec.get("updated_ms")),
        "stages": {
            "render": _stage(render.get("started_ms"), render.get("finished_ms"), render.get("ms")),
            "encode": _stage(
                stages.get("fanout:encoding"), enc_done, sum(encode_ms) if encode_ms else None
            ),
            "prefill": _stage(prefill_start, decode_start or done),
            "decode": _stage(decode_start, done if decode_start is not None else None),
        },
        "items": items,
        "result": result,
        "error": error,
        "metadata": rec.get("metadata"),
    }
