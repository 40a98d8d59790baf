"""Pure parts of the DLQ tooling: --since and position parsing, replay checks and headers."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import torch

from consumers.dead_letters.reader import (
    DeadLetterRecord,
    LetterFilter,
    parse_position,
    parse_since,
)
from consumers.dead_letters.replay import (
    ReplayLedger,
    check_claims,
    check_replayable,
    replay_headers,
)
from runtime.stores.local import LocalStore
from schemas import codec
from schemas.dead_letters import REPLAY_COUNT_HEADER, REPLAYED_FROM_HEADER, VALUE_DROPPED_HEADER
from schemas.keys import claim_key
from schemas.topics import Topics
from schemas.types import (
    DeadLetter,
    ECTransfer,
    EncodedEvent,
    EncodeEvent,
    ErrorInfo,
    Features,
    PrefillEvent,
    ResultEvent,
    TensorRef,
)
from schemas.validator import ValidationConfig

TOPICS = Topics("t")
CONFIG = ValidationConfig()
NOW = 1_800_000_000_000


def test_since_takes_durations_and_iso_times() -> None:
    assert parse_since("90s", NOW) == NOW - 90_000
    assert parse_since("1h30m", NOW) == NOW - 5_400_000
    assert parse_since("2d", NOW) == NOW - 2 * 86_400_000
    iso = datetime(2026, 11, 30, 21, 0, tzinfo=UTC)
    assert parse_since("2026-11-30T21:00:00Z") == int(iso.timestamp() * 1000)
    assert parse_since("2026-11-30T21:00:00") == int(iso.timestamp() * 1000)  # naive is UTC
    for bad in ("yesterday", "5x", "", "1h junk"):
        with pytest.raises(ValueError, match="expected a duration"):
            parse_since(bad, NOW)


def test_position_is_offset_or_partition_offset() -> None:
    assert parse_position("17") == (None, 17)
    assert parse_position("2:17") == (2, 17)
    for bad in ("a", "1:2:3", "-1", "1:"):
        with pytest.raises(ValueError, match="PARTITION:OFFSET"):
            parse_position(bad)


def _rec(
    value: bytes, *, topic: str = TOPICS.results, headers: dict[str, bytes] | None = None
) -> DeadLetterRecord:
    err = ErrorInfo("retries_exhausted", "ConnectionError: down", rule="r1")
    letter = DeadLetter(topic, 1, 5, b"k", value, "g", err, 3, dict(headers or {}), NOW)
    return DeadLetterRecord(TOPICS.dlq, 0, 9, NOW, letter)


def _code(r: DeadLetterRecord, now: int = NOW) -> str | None:
    reason = check_replayable(r, TOPICS, CONFIG, now)
    return reason.code if reason is not None else None


def test_replay_checks_name_why_a_record_stays_put() -> None:
    ok = codec.encode(ResultEvent("r", "s", "completed"))
    assert _code(_rec(ok)) is None
    assert _code(_rec(ok, topic="other.results")) == "unknown-topic"
    assert _code(_rec(ok, topic=TOPICS.dlq)) == "unknown-topic"
    assert _code(_rec(b"\x00junk")) == "undecodable"
    # A valid event of the wrong type for its topic would fail at the worker again.
    encoded = codec.encode(EncodedEvent("h", "r", "tiny", "redis://", "k", "float32", [1]))
    assert _code(_rec(encoded)) == "undecodable"
    dropped = _rec(b"", headers={VALUE_DROPPED_HEADER: b"99999"})
    reason = check_replayable(dropped, TOPICS, CONFIG, NOW)
    assert reason is not None and reason.code == "payload-dropped" and "99999" in reason.message
    replayed = _rec(ok, headers={REPLAYED_FROM_HEADER: b"t.dlq:0:3", REPLAY_COUNT_HEADER: b"1"})
    assert _code(replayed) == "replay-failed-again"
    late = PrefillEvent("r", "tiny", [1, 2], Features({}, {}), deadline_ms=NOW - 1)
    assert _code(_rec(codec.encode(late), topic=TOPICS.prefill)) == "expired"
    assert _code(_rec(codec.encode(late), topic=TOPICS.prefill), now=NOW - 2) is None
    undecodable_dlq = DeadLetterRecord(TOPICS.dlq, 0, 1, NOW, None, "bad frame")
    assert _code(undecodable_dlq) == "dlq-undecodable"


def test_replay_headers_drop_error_headers_and_count_replays() -> None:
    r = _rec(b"x", headers={"epd-schema": b"epd.ResultEvent", "epd-error-code": b"x"})
    assert replay_headers(r) == [
        ("epd-schema", b"epd.ResultEvent"),
        (REPLAYED_FROM_HEADER, b"t.dlq:0:9"),
        (REPLAY_COUNT_HEADER, b"1"),
    ]


def test_filter_matches_rule_code_and_time() -> None:
    r = _rec(b"x")
    assert LetterFilter()(r)
    assert LetterFilter(rule="r1", code="retries_exhausted", since_ms=NOW)(r)
    assert not LetterFilter(rule="r2")(r)
    assert not LetterFilter(code="validation")(r)
    assert not LetterFilter(since_ms=NOW + 1)(r)


async def test_replay_checks_that_claim_checked_inputs_still_exist() -> None:
    store = LocalStore(f"local://dlq-{uuid.uuid4().hex[:8]}")
    claim = claim_key("ec", "h", "pixel_values")
    ref = TensorRef(store.url, claim, "float32", [4, 4], 64, "d" * 64)
    grid = torch.tensor([[1, 2, 2]])
    ec = ECTransfer("h", store.url, "ec:fp:h", NOW)
    ev = EncodeEvent(
        "r", "tiny", "image", 0, "h", {"pixel_values": ref, "image_grid_thw": grid}, ec
    )
    r = _rec(codec.encode(ev), topic=TOPICS.encode)
    try:
        reason = await check_claims(r, store)
        assert reason is not None and reason.code == "claim-check-gone"
        assert (reason.rule, reason.modality, reason.item, reason.field) == (
            "claim-check",
            "image",
            0,
            "pixel_values",
        )
        await store.put_bytes(claim, b"\0" * 64)
        assert await check_claims(r, store) is None  # the input is still there
        await store.delete(claim)
        await store.put("ec:fp:h", torch.zeros(2, 2))
        assert await check_claims(r, store) is None  # gone, but the worker will have a hit
    finally:
        await store.close()


def test_ledger_key_tells_apart_dead_letters_at_a_reused_position() -> None:
    # A recreated DLQ topic (or a restarted in-memory broker) hands out offset 9 again.
    ledger = ReplayLedger(None, prefix="t", ttl_s=60)  # type: ignore[arg-type]  # key() only
    old, new = _rec(b"x"), _rec(b"x")
    assert new.letter is not None
    new.letter.failed_ms += 1
    assert ledger.key(old) != ledger.key(new)
    assert ledger.key(old) == f"t:dlq-replayed:{TOPICS.dlq}:0:9:{NOW}"
