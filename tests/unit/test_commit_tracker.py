"""CommitTracker: ordered commits over out-of-order completion (pure logic)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumers.commits import CommitTracker
from consumers.retry import Poison, backoff_delay, default_is_transient, error_info
from runtime.stores.errors import StoreUnavailable
from schemas.errors import CodecError, ValidationError

A, B = ("t", 0), ("t", 1)


def test_nothing_seen_nothing_to_commit() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    assert t.committable(A) is None
    assert t.to_commit() == {}
    assert t.in_flight() == 0


def test_in_order_completion() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    for off in range(3):
        t.add(A, off)
    assert t.committable(A) == 0
    t.done(A, 0)
    assert t.committable(A) == 1
    t.done(A, 1)
    t.done(A, 2)
    assert t.committable(A) == 3
    assert t.in_flight(A) == 0


def test_out_of_order_waits_for_lowest() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    for off in range(10, 15):
        t.add(A, off)
    for off in (14, 13, 12, 11):
        assert t.done(A, off)
        assert t.committable(A) == 10, "a later offset must not move the commit past 10"
    assert t.done(A, 10)
    assert t.committable(A) == 15


def test_gap_in_offsets() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    t.add(A, 5)
    t.add(A, 9)  # compaction / transaction markers leave gaps
    t.done(A, 9)
    assert t.committable(A) == 5
    t.done(A, 5)
    assert t.committable(A) == 10


def test_partitions_are_independent() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    t.add(A, 0)
    t.add(B, 100)
    t.add(B, 101)
    t.done(B, 100)
    assert t.to_commit() == {B: 101}
    assert t.committable(A) == 0
    assert t.in_flight() == 2
    assert t.in_flight(B) == 1
    assert t.pending_offsets(B) == [101]


def test_to_commit_only_reports_progress() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    t.add(A, 0)
    t.add(A, 1)
    assert t.to_commit() == {}, "nothing finished yet: committing 0 would record nothing"
    t.done(A, 0)
    assert t.to_commit() == {A: 1}
    t.mark_committed({A: 1})
    assert t.to_commit() == {}, "no new progress, nothing to commit again"
    t.done(A, 1)
    assert t.to_commit() == {A: 2}
    assert t.to_commit([B]) == {}


def test_done_rejects_unknown_repeat_and_stale() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    epoch = t.add(A, 0)
    assert not t.done(A, 7)
    assert not t.done(B, 0)
    assert t.done(A, 0, epoch)
    assert not t.done(A, 0, epoch), "second done of the same offset is a no-op"
    t.forget(A)
    new_epoch = t.add(A, 0)  # reassigned, re-delivered from the committed offset
    assert new_epoch != epoch
    assert not t.done(A, 0, epoch), "a task from the previous assignment must not count"
    assert t.committable(A) == 0
    assert t.done(A, 0, new_epoch)


def test_offsets_must_increase() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    t.add(A, 5)
    with pytest.raises(ValueError, match="increasing"):
        t.add(A, 5)
    with pytest.raises(ValueError, match="increasing"):
        t.add(A, 3)


def test_forget_drops_state() -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    t.add(A, 0)
    t.forget(A)
    assert t.committable(A) is None
    assert t.partitions() == []
    t.mark_committed({A: 3})  # ignored, no error


@given(st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=60), st.randoms())
def test_property_committable_is_lowest_unfinished(gaps: list[int], rnd: random.Random) -> None:
    t: CommitTracker[tuple[str, int]] = CommitTracker()
    offsets, off = [], 0
    for g in gaps:
        off += g
        offsets.append(off)
        t.add(A, off)
        off += 1
    finished: set[int] = set()
    order = offsets[:]
    rnd.shuffle(order)
    last = -1
    for o in order:
        assert t.done(A, o)
        finished.add(o)
        unfinished = [x for x in offsets if x not in finished]
        expect = min(unfinished) if unfinished else offsets[-1] + 1
        got = t.committable(A)
        assert got == expect
        assert got >= last, "the committable offset never moves backwards"
        last = got
        # everything below the committable offset is finished
        assert all(x in finished for x in offsets if x < got)


def test_classification_and_error_info() -> None:
    assert not default_is_transient(Poison("bad"))
    assert not default_is_transient(CodecError("x"))
    assert not default_is_transient(ValidationError("rule-3", "m"))
    for exc in (StoreUnavailable("down"), ConnectionError(), TimeoutError(), RuntimeError()):
        assert default_is_transient(exc)
    info = error_info(ValidationError("ec-params", "needs params", modality="image", item=2))
    assert (info.code, info.rule, info.modality, info.item) == (
        "validation",
        "ec-params",
        "image",
        2,
    )
    assert info.message == "needs params"
    assert error_info(CodecError("bad magic")).code == "undecodable"
    assert error_info(Poison("late", code="expired")).code == "expired"
    assert (
        error_info(RuntimeError("boom"), code="retries_exhausted").message == "RuntimeError: boom"
    )


def test_backoff_grows_and_caps() -> None:
    for attempt, cap in ((1, 0.2), (2, 0.4), (3, 0.8), (10, 5.0)):
        d = backoff_delay(attempt, 0.2, 5.0)
        assert cap / 2 <= d <= cap
