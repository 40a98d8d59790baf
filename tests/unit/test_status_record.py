"""The typed status record (schemas.status_record): JSON as the store has always written it,
the fold, and the names of the record's maps (pure: no Redis)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from schemas.status_record import (
    StatusRecord,
    created,
    encode_stage,
    encoded_update,
    fanout_info,
    fold,
    short_hash,
    stage_key,
)
from schemas.types import EncodedEvent, ErrorInfo, ResultEvent

GOLDEN = json.loads((Path(__file__).parent / "golden" / "status_records_v1.json").read_text())
RECORDS: dict[str, str] = GOLDEN["records"]
TIMES = {"created_ms", "updated_ms", "finished_ms"}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_a_record_the_old_store_wrote_reads_and_writes_back_as_the_same_text(name: str) -> None:
    text = RECORDS[name]
    rec = StatusRecord.from_json(text)
    assert rec.to_json() == text
    assert StatusRecord.from_dict(json.loads(text)).to_dict() == json.loads(text)


def test_the_frozen_records_read_as_what_they_say() -> None:
    api = StatusRecord.from_json(RECORDS["api_completed"])
    a, b = "a" * 64, "b" * 64
    assert api.status == "completed" and api.terminal and api.token_ids == [1, 2, 3]
    assert api.tenant == "acme" and api.metadata == {"k": "v"} and api.cached == [b]
    assert [it["mm_hash"] for it in api.items] == [a, b] and api.render["ms"] == 1.0
    assert api.item_encoded(a) and api.item_encoded(b) and api.encoded_items() == {a[:12], b[:12]}
    assert api.encode_ms(a) == 7 and api.encode_hop_ms(a) == 0.5 and api.encode_ms(b) is None
    assert api.deadline_ms == 1_700_000_600_000 and api.encode_events == 1
    assert api.stage_time("prefill", "completed") == api.finished_ms
    assert api.reached("fanout") and api.reached("prefill") and not api.reached("sweep")
    assert api.encode_finished_ms() == api.stages_last["encode:encoding"]
    assert api.encode_total_ms() == 7 + 5.0 + 6.0
    router = StatusRecord.from_json(RECORDS["router_rejected"])
    assert router.status == "rejected" and router.error is not None
    assert router.error["rule"] == "ec-transfer-required" and router.tenant is None
    assert router.cached is None and router.items == [] and router.token_ids is None
    open_ = StatusRecord.from_json(RECORDS["open_encoding"])
    assert not open_.terminal and open_.tenant is None and "tenant" in open_.fields
    assert open_.encoded_items() == frozenset() and open_.finished_ms is None
    cancelled = StatusRecord.from_json(RECORDS["cancelled"])
    assert cancelled.status == "cancelled" and cancelled.error == {
        "code": "cancelled",
        "message": "cancelled by the client",
        "rule": None,
        "modality": None,
        "item": None,
        "field": None,
    }


def test_a_key_this_version_does_not_know_survives_a_fold() -> None:
    raw = json.loads(RECORDS["open_encoding"])
    raw["written_by_a_newer_version"] = {"x": [1, 2]}
    rec = fold(StatusRecord.from_dict(raw), ResultEvent(raw["request_id"], "prefill", "decoding"))
    assert rec is not None
    out = rec.to_dict()
    assert out["written_by_a_newer_version"] == {"x": [1, 2]} and out["status"] == "decoding"
    assert list(out)[: len(raw)] == list(raw)  # the order it came in, new keys after it


def _without_times(d: dict[str, Any]) -> dict[str, Any]:
    """A record's object with its clock readings blanked (the replay runs at another time)."""
    out = {k: ("T" if k in TIMES else v) for k, v in d.items()}
    for name in ("stages", "stages_last"):
        if name in out:
            out[name] = dict.fromkeys(out[name], "T")
    return out


def _replay_api_request() -> StatusRecord:
    """The same updates tests/unit/golden/status_records_v1.json's ``api_completed`` got."""
    rid, a, b = "req-api", "a" * 64, "b" * 64
    fields = {
        "tenant": "acme",
        "metadata": {"k": "v"},
        "info": {"trace_id": "ab" * 16},
        "items": [{"modality": "image", "mm_hash": a}, {"modality": "image", "mm_hash": b}],
        "render": {"started_ms": 1, "finished_ms": 2, "ms": 1.0},
    }
    rec: StatusRecord | None = created(rid, fields).with_fields({"cached": [b]})
    enc_a = EncodedEvent(a, rid, "tiny", "redis://", "ec:fp:a", "float32", [4, 8], encode_ms=7)
    enc_b = EncodedEvent(b, rid, "tiny", "redis://", "ec:fp:b", "float32", [], cache_hit=True)
    updates = [
        ResultEvent(
            rid,
            "fanout",
            "encoding",
            timings={"fanout": 1.5},
            info=fanout_info(encode_events=1, deadline_ms=1_700_000_600_000),
        ),
        encoded_update(enc_a, hop_ms=0.5),
        encoded_update(enc_b),
        ResultEvent(rid, "encode", "encoding", timings={"encode.image0": 5.0}),
        ResultEvent(rid, "encode", "encoding", timings={"encode.image1": 6.0}),
        ResultEvent(rid, "prefill", "prefilling", timings={"wait": 3.0}),
        ResultEvent(rid, "prefill", "decoding"),
        ResultEvent(
            rid, "prefill", "completed", token_ids=[1, 2, 3], text="abc", timings={"total": 12.0}
        ),
    ]
    for ev in updates:
        rec = fold(rec, ev) or rec
    assert rec is not None
    return rec


def test_the_fold_builds_what_the_old_store_built_key_for_key_in_order() -> None:
    got = _replay_api_request().to_dict()
    want = json.loads(RECORDS["api_completed"])
    assert list(got) == list(want)
    assert _without_times(got) == _without_times(want)


def test_a_router_record_from_nothing_has_the_old_key_order() -> None:
    err = ErrorInfo(
        "rejected", "no ec entry", "ec-transfer-required", "image", 1, "ec_transfer_params"
    )
    rec = fold(None, ResultEvent("req-router", "prefill", "rejected", error=err))
    rec = fold(rec, ResultEvent("req-router", "prefill", "completed", token_ids=[9]))
    assert rec is not None and rec.status == "rejected" and rec.token_ids is None  # first wins
    want = json.loads(RECORDS["router_rejected"])
    assert list(rec.to_dict()) == list(want)
    assert _without_times(rec.to_dict()) == _without_times(want)


def test_the_event_stream_entries_are_the_old_ones() -> None:
    rec = created("req-api", {})
    want = [json.loads(e) for e in GOLDEN["events"]["api_completed"]]
    assert json.loads(rec.change_entry("api")).keys() == want[0].keys()
    done = StatusRecord.from_json(RECORDS["api_completed"])
    entry = json.loads(done.change_entry("prefill"))
    assert entry == {**want[-1], "at_ms": done.updated_ms}


def test_the_fold_never_changes_the_record_it_was_given() -> None:
    before = StatusRecord.from_json(RECORDS["open_encoding"])
    text = before.to_json()
    after = fold(before, ResultEvent(before.request_id, "prefill", "completed", token_ids=[1]))
    assert after is not None and after.status == "completed"
    assert before.to_json() == text and before.status == "encoding"


def test_with_fields_merges_top_level_fields_and_sets_the_folds_own() -> None:
    rec = created("r", {"tenant": "t", "info": {"trace_id": "x"}}, at_ms=5)
    assert rec.info == {"trace_id": "x"} and rec.stages == {"api:queued": 5}
    assert rec.updated_ms == 5 and rec.tenant == "t"
    more = rec.with_fields({"cached": ["h"]})
    assert more.cached == ["h"] and rec.cached is None


def test_names_inside_the_record() -> None:
    h = "0123456789abcdef" * 4
    assert short_hash(h) == "0123456789ab" and encode_stage(h) == "encode.0123456789ab"
    assert stage_key("prefill", "completed") == "prefill:completed"
    assert fanout_info(encode_events=2, deadline_ms=None) == {
        "encode_events": "2",
        "deadline_ms": "None",
    }
    rec = StatusRecord("r", info=fanout_info(encode_events=2, deadline_ms=None))
    assert rec.deadline_ms is None and rec.encode_events == 2 and rec.items_pending()
    rec = fold(rec, encoded_update(EncodedEvent(h, "r", "m", "s", "k", "float32", [1])))
    assert rec is not None and rec.items_pending()  # one of two marked
    failed = EncodedEvent("f" * 64, "r", "m", "s", "k", "float32", [1], ok=False)
    rec = fold(rec, encoded_update(failed))
    assert rec is not None and not rec.items_pending() and rec.encoded_items() == {h[:12]}
