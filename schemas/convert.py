"""Event dataclasses <-> Avro-shaped dicts (what fastavro reads and writes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.tensors import value_from_avro, value_to_avro
from schemas.types import (
    DeadLetter,
    ECTransfer,
    EncodedEvent,
    EncodeEvent,
    ErrorInfo,
    Event,
    Features,
    ItemData,
    PlaceholderRange,
    PrefillEvent,
    RenderEvent,
    ResultEvent,
    SamplingParams,
)

Slots = dict[str, list[ItemData | None]]


def _item_to(item: ItemData | None) -> dict[str, Any] | None:
    return None if item is None else {k: value_to_avro(v) for k, v in item.items()}


def _item_from(rec: dict[str, Any] | None) -> ItemData | None:
    return None if rec is None else {k: value_from_avro(v) for k, v in rec.items()}


def _slots_to(slots: Slots | None) -> dict[str, Any] | None:
    if slots is None:
        return None
    return {m: [_item_to(it) for it in items] for m, items in slots.items()}


def _slots_from(rec: dict[str, Any] | None) -> Slots | None:
    if rec is None:
        return None
    return {m: [_item_from(it) for it in items] for m, items in rec.items()}


def features_to(f: Features) -> dict[str, Any]:
    return {
        "mm_hashes": {m: list(h) for m, h in f.mm_hashes.items()},
        "mm_placeholders": {
            m: [{"offset": p.offset, "length": p.length, "is_embed": p.is_embed} for p in ps]
            for m, ps in f.mm_placeholders.items()
        },
        "kwargs_data": _slots_to(f.kwargs_data),
        "mm_metadata": _slots_to(f.mm_metadata),
    }


def features_from(r: dict[str, Any]) -> Features:
    return Features(
        mm_hashes=r["mm_hashes"],
        mm_placeholders={
            m: [PlaceholderRange(p["offset"], p["length"], p["is_embed"]) for p in ps]
            for m, ps in r["mm_placeholders"].items()
        },
        kwargs_data=_slots_from(r["kwargs_data"]),
        mm_metadata=_slots_from(r["mm_metadata"]),
    )


def _ec_to(e: ECTransfer) -> dict[str, Any]:
    return {
        "mm_hash": e.mm_hash,
        "store": e.store,
        "key": e.key,
        "expires_ms": e.expires_ms,
        "signature": e.signature,
    }


def _ec_from(r: dict[str, Any]) -> ECTransfer:
    return ECTransfer(r["mm_hash"], r["store"], r["key"], r["expires_ms"], r["signature"])


def _sampling_to(s: SamplingParams) -> dict[str, Any]:
    return {
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }


def _sampling_from(r: dict[str, Any]) -> SamplingParams:
    return SamplingParams(r["max_tokens"], r["temperature"], r["stop_token_ids"], r["ignore_eos"])


def _error_to(e: ErrorInfo | None) -> dict[str, Any] | None:
    if e is None:
        return None
    return {
        "code": e.code,
        "message": e.message,
        "rule": e.rule,
        "modality": e.modality,
        "item": e.item,
        "field": e.field,
    }


def _error_from(r: dict[str, Any] | None) -> ErrorInfo | None:
    if r is None:
        return None
    return ErrorInfo(r["code"], r["message"], r["rule"], r["modality"], r["item"], r["field"])


def _render_to(e: RenderEvent) -> dict[str, Any]:
    return {
        "request_id": e.request_id,
        "model": e.model,
        "token_ids": e.token_ids,
        "features": features_to(e.features),
        "sampling": _sampling_to(e.sampling),
        "cache_salt": e.cache_salt,
        "deadline_ms": e.deadline_ms,
        "created_ms": e.created_ms,
        "trace": e.trace,
    }


def _render_from(r: dict[str, Any]) -> RenderEvent:
    return RenderEvent(
        request_id=r["request_id"],
        model=r["model"],
        token_ids=r["token_ids"],
        features=features_from(r["features"]),
        sampling=_sampling_from(r["sampling"]),
        cache_salt=r["cache_salt"],
        deadline_ms=r["deadline_ms"],
        created_ms=r["created_ms"],
        trace=r["trace"],
    )


def _encode_to(e: EncodeEvent) -> dict[str, Any]:
    return {
        "request_id": e.request_id,
        "model": e.model,
        "modality": e.modality,
        "item_index": e.item_index,
        "mm_hash": e.mm_hash,
        "data": _item_to(e.data),
        "ec_transfer": _ec_to(e.ec_transfer),
        "deadline_ms": e.deadline_ms,
        "created_ms": e.created_ms,
        "trace": e.trace,
    }


def _encode_from(r: dict[str, Any]) -> EncodeEvent:
    return EncodeEvent(
        request_id=r["request_id"],
        model=r["model"],
        modality=r["modality"],
        item_index=r["item_index"],
        mm_hash=r["mm_hash"],
        data=_item_from(r["data"]) or {},
        ec_transfer=_ec_from(r["ec_transfer"]),
        deadline_ms=r["deadline_ms"],
        created_ms=r["created_ms"],
        trace=r["trace"],
    )


def _prefill_to(e: PrefillEvent) -> dict[str, Any]:
    return {
        "request_id": e.request_id,
        "model": e.model,
        "token_ids": e.token_ids,
        "features": features_to(e.features),
        "ec_transfer_params": {h: _ec_to(x) for h, x in e.ec_transfer_params.items()},
        "sampling": _sampling_to(e.sampling),
        "cache_salt": e.cache_salt,
        "deadline_ms": e.deadline_ms,
        "created_ms": e.created_ms,
        "trace": e.trace,
    }


def _prefill_from(r: dict[str, Any]) -> PrefillEvent:
    return PrefillEvent(
        request_id=r["request_id"],
        model=r["model"],
        token_ids=r["token_ids"],
        features=features_from(r["features"]),
        ec_transfer_params={h: _ec_from(x) for h, x in r["ec_transfer_params"].items()},
        sampling=_sampling_from(r["sampling"]),
        cache_salt=r["cache_salt"],
        deadline_ms=r["deadline_ms"],
        created_ms=r["created_ms"],
        trace=r["trace"],
    )


def _encoded_to(e: EncodedEvent) -> dict[str, Any]:
    return {
        "mm_hash": e.mm_hash,
        "request_id": e.request_id,
        "model": e.model,
        "store": e.store,
        "key": e.key,
        "dtype": e.dtype,
        "shape": list(e.shape),
        "ok": e.ok,
        "error": _error_to(e.error),
        "cache_hit": e.cache_hit,
        "encode_ms": e.encode_ms,
        "created_ms": e.created_ms,
    }


def _encoded_from(r: dict[str, Any]) -> EncodedEvent:
    return EncodedEvent(
        mm_hash=r["mm_hash"],
        request_id=r["request_id"],
        model=r["model"],
        store=r["store"],
        key=r["key"],
        dtype=r["dtype"],
        shape=r["shape"],
        ok=r["ok"],
        error=_error_from(r["error"]),
        cache_hit=r["cache_hit"],
        encode_ms=r["encode_ms"],
        created_ms=r["created_ms"],
    )


def _result_to(e: ResultEvent) -> dict[str, Any]:
    return {
        "request_id": e.request_id,
        "stage": e.stage,
        "status": e.status,
        "token_ids": e.token_ids,
        "text": e.text,
        "error": _error_to(e.error),
        "timings": e.timings,
        "info": e.info,
        "worker": e.worker,
        "created_ms": e.created_ms,
    }


def _result_from(r: dict[str, Any]) -> ResultEvent:
    return ResultEvent(
        request_id=r["request_id"],
        stage=r["stage"],
        status=r["status"],
        token_ids=r["token_ids"],
        text=r["text"],
        error=_error_from(r["error"]),
        timings=r["timings"],
        info=r["info"],
        worker=r["worker"],
        created_ms=r["created_ms"],
    )


def _dlq_to(e: DeadLetter) -> dict[str, Any]:
    return {
        "original_topic": e.original_topic,
        "partition": e.partition,
        "offset": e.offset,
        "key": e.key,
        "value": e.value,
        "consumer_group": e.consumer_group,
        "error": _error_to(e.error),
        "attempts": e.attempts,
        "headers": e.headers,
        "failed_ms": e.failed_ms,
    }


def _dlq_from(r: dict[str, Any]) -> DeadLetter:
    err = _error_from(r["error"])
    assert err is not None
    return DeadLetter(
        original_topic=r["original_topic"],
        partition=r["partition"],
        offset=r["offset"],
        key=r["key"],
        value=r["value"],
        consumer_group=r["consumer_group"],
        error=err,
        attempts=r["attempts"],
        headers=r["headers"],
        failed_ms=r["failed_ms"],
    )


TO_AVRO: dict[type, tuple[str, Callable[[Any], dict[str, Any]]]] = {
    RenderEvent: ("epd.RenderEvent", _render_to),
    EncodeEvent: ("epd.EncodeEvent", _encode_to),
    PrefillEvent: ("epd.PrefillEvent", _prefill_to),
    EncodedEvent: ("epd.EncodedEvent", _encoded_to),
    ResultEvent: ("epd.ResultEvent", _result_to),
    DeadLetter: ("epd.DeadLetter", _dlq_to),
}
FROM_AVRO: dict[str, Callable[[dict[str, Any]], Event]] = {
    "epd.RenderEvent": _render_from,
    "epd.EncodeEvent": _encode_from,
    "epd.PrefillEvent": _prefill_from,
    "epd.EncodedEvent": _encoded_from,
    "epd.ResultEvent": _result_from,
    "epd.DeadLetter": _dlq_from,
}
