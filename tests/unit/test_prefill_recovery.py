"""What the prefill worker decides from a request's status record: skip a replay, or call a
missing embedding lost (pure logic; the workers themselves are in tests/integration)."""

from __future__ import annotations

from gpu_workers.prefill import embeddings_lost
from runtime.status_store import RequestState, encoded_items

A = "a" * 64
B = "b" * 64


def test_encoded_items_reads_encoded_and_cache_hits_only() -> None:
    info = {
        f"encoded.{A[:12]}": "encoded",
        f"encoded.{B[:12]}": "cache_hit",
        "encoded.cccccccccccc": "something else",
        f"encode_failed.{'d' * 12}": "error",
        "prefill.cancelled": "x",
    }
    assert encoded_items(info) == {A[:12], B[:12]}


def test_terminal_states_are_the_ones_a_replay_skips() -> None:
    for status in ("completed", "failed", "cancelled", "expired", "rejected"):
        assert RequestState(status, frozenset()).terminal
    for pending in (None, "queued", "encoding", "prefilling", "decoding"):
        assert not RequestState(pending, frozenset()).terminal


def test_a_missing_item_the_record_says_was_encoded_is_lost() -> None:
    state = RequestState("prefilling", frozenset({A[:12]}))
    assert embeddings_lost([A, B], state, created_ms=1_000) == [A]
    assert embeddings_lost([B], state, created_ms=1_000) == []  # B may still be encoding


def test_a_record_wiped_by_a_restart_loses_every_missing_item() -> None:
    wiped = RequestState(None, frozenset(), records_since_ms=5_000)
    assert embeddings_lost([A, B], wiped, created_ms=4_000) == [A, B]
    # Remade after the restart from later updates only: still wiped.
    remade = RequestState("prefilling", frozenset(), oldest_ms=6_000, records_since_ms=5_000)
    assert remade.wiped
    assert embeddings_lost([A], remade, created_ms=4_000) == [A]


def test_no_loss_is_inferred_for_a_new_request_or_a_surviving_record() -> None:
    wiped = RequestState(None, frozenset(), records_since_ms=5_000)
    # Created after Redis (re)started: its record may simply not be written yet.
    assert embeddings_lost([A], wiped, created_ms=5_000) == []
    # The record kept updates from before the start (a Redis with persistence): B is still
    # being encoded, not lost.
    kept = RequestState("prefilling", frozenset(), oldest_ms=4_500, records_since_ms=5_000)
    assert not kept.wiped
    assert embeddings_lost([B], kept, created_ms=4_000) == []
    # Not asked when Redis started: nothing is inferred from a missing record.
    assert embeddings_lost([A], RequestState(None, frozenset()), created_ms=1) == []


def test_an_unreadable_record_decides_nothing() -> None:
    assert embeddings_lost([A], None, created_ms=1) == []
