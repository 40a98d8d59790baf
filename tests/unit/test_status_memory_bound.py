"""The records a StatusStore remembers (its starting guesses for the next update) are bounded
in count and in characters: a few huge records cannot hold hundreds of MB in every process
(the results collector reached 814 MB in issue 21, defect 13)."""

from __future__ import annotations

from unittest.mock import MagicMock

from runtime.status import StatusStore


def test_remembered_records_are_bounded_in_characters_too() -> None:
    store = StatusStore(MagicMock(), prefix="p")
    big = "x" * (4 * 1024 * 1024)
    for i in range(20):  # 80 MB of records, under the count bound
        store._known.put(f"r{i}", big)
    held = sum(len(store._known.get(f"r{i}") or "") for i in range(20))
    assert held <= StatusStore.REMEMBER_CHARS and store._known.held_chars == held
    assert "r19" in store._known and "r0" not in store._known  # the newest are kept
    store._known.put("r19", None)
    assert "r19" not in store._known and store._known.held_chars == held - len(big)
    for i in range(StatusStore.REMEMBER + 50):  # small ones: the count bound still holds
        store._known.put(f"s{i}", "{}")
    assert len(store._known) == StatusStore.REMEMBER
