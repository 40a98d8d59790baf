"""The parallel run's file order (tests/scheduling.py): heaviest first, by the last run's
durations or, for tests no run has timed, by their marks; each file's tests keep their order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests import scheduling


@dataclass
class FakeItem:
    nodeid: str
    marks: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> Any:
        return name if name in self.marks else None


def _order(items: list[Any], known: dict[str, float]) -> list[str]:
    scheduling.heaviest_files_first(items, known)
    return [i.nodeid for i in items]


def test_files_go_heaviest_first_and_keep_their_own_order() -> None:
    items = [
        FakeItem("tests/unit/test_a.py::one"),
        FakeItem("tests/unit/test_b.py::one"),
        FakeItem("tests/unit/test_a.py::two"),
        FakeItem("tests/unit/test_c.py::one"),
    ]
    known = {
        "tests/unit/test_a.py::one": 1.0,
        "tests/unit/test_a.py::two": 2.0,
        "tests/unit/test_b.py::one": 9.0,
        "tests/unit/test_c.py::one": 0.5,
    }
    assert _order(items, known) == [
        "tests/unit/test_b.py::one",
        "tests/unit/test_a.py::one",
        "tests/unit/test_a.py::two",
        "tests/unit/test_c.py::one",
    ]


def test_untimed_tests_weigh_by_their_marks() -> None:
    items = [
        FakeItem("tests/unit/test_fast.py::a"),
        FakeItem("tests/unit/test_fast.py::b"),
        FakeItem("tests/integration/test_mid.py::a", {"integration"}),
        FakeItem("tests/unit/test_smoke.py::a", {"slow"}),
        FakeItem("tests/unit/test_smoke.py::b"),
    ]
    assert [i.split("::")[0] for i in _order(items, {})] == [
        "tests/unit/test_smoke.py",
        "tests/unit/test_smoke.py",
        "tests/integration/test_mid.py",
        "tests/unit/test_fast.py",
        "tests/unit/test_fast.py",
    ]
    # a timed test counts what it took, not its mark's prior
    timed = {"tests/unit/test_smoke.py::a": 0.2, "tests/unit/test_fast.py::a": 50.0}
    assert _order(items, timed)[0] == "tests/unit/test_fast.py::a"


def test_equal_weights_keep_a_stable_order() -> None:
    items = [FakeItem("tests/unit/test_z.py::a"), FakeItem("tests/unit/test_y.py::a")]
    # same weight: by path, so every xdist worker computes the same order
    assert _order(items, {}) == ["tests/unit/test_y.py::a", "tests/unit/test_z.py::a"]


def test_only_xdist_workers_reorder(monkeypatch: pytest.MonkeyPatch) -> None:
    items: list[Any] = [FakeItem("tests/unit/test_b.py::a"), FakeItem("tests/unit/test_a.py::a")]
    before = list(items)

    class Config:
        cache = None

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    scheduling.order(Config(), items)  # type: ignore[arg-type]
    assert items == before
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    scheduling.order(Config(), items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["tests/unit/test_a.py::a", "tests/unit/test_b.py::a"]


def test_recorder_adds_up_the_phases_and_merges_into_the_cache() -> None:
    class Cache:
        def __init__(self) -> None:
            self.data: dict[str, Any] = {scheduling.CACHE_KEY: {"old::t": 4.0, "x::t": 1.0}}

        def get(self, key: str, default: Any) -> Any:
            return self.data.get(key, default)

        def set(self, key: str, value: Any) -> None:
            self.data[key] = value

    class Report:
        def __init__(self, nodeid: str, duration: float) -> None:
            self.nodeid, self.duration = nodeid, duration

    class Session:
        class config:  # stands in for pytest.Config
            cache = Cache()

    recorder = scheduling.DurationRecorder()
    for phase_s in (0.5, 2.0, 0.25):  # setup, call, teardown
        recorder.pytest_runtest_logreport(Report("x::t", phase_s))  # type: ignore[arg-type]
    recorder.pytest_sessionfinish(Session())  # type: ignore[arg-type]
    assert Session.config.cache.data[scheduling.CACHE_KEY] == {"old::t": 4.0, "x::t": 2.75}
