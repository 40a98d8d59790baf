"""The order test files start in under ``pytest -n N --dist loadfile --no-loadscope-reorder``
(what ``make test`` runs): the heaviest first, so that no long file starts last and holds the
run up while the other workers are idle (longest-processing-time-first scheduling).

How heavy a file is: the sum of its selected tests' durations (setup, call and teardown) in the
last run that ran them, kept in pytest's cache (``.pytest_cache``, key ``scheduling/durations``,
written at the end of every run, serial or parallel); for a test the cache does not know, a
prior from its marks (``slow``, ``integration``). Files keep their own order inside.

Only the xdist workers reorder (each computes the same order from the same cache and marks,
as xdist requires); a serial run keeps pytest's order.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import pytest

CACHE_KEY = "scheduling/durations"
PRIOR_S = {"slow": 30.0, "integration": 3.0}
"""Seconds a test the cache does not know is taken to last, by mark (else ``DEFAULT_S``)."""
DEFAULT_S = 0.1


def in_worker() -> bool:
    """Whether this process is an xdist worker."""
    return "PYTEST_XDIST_WORKER" in os.environ


def _cache(config: pytest.Config) -> Any | None:
    return getattr(config, "cache", None)


def known_durations(config: pytest.Config) -> dict[str, float]:
    """``{node id: seconds}`` from the last runs (empty without a cache)."""
    cache = _cache(config)
    got = cache.get(CACHE_KEY, {}) if cache is not None else {}
    return got if isinstance(got, dict) else {}


def prior_s(item: pytest.Item) -> float:
    """How long ``item`` is taken to last when no run has timed it yet."""
    for mark, seconds in PRIOR_S.items():
        if item.get_closest_marker(mark) is not None:
            return seconds
    return DEFAULT_S


def heaviest_files_first(items: list[pytest.Item], known: dict[str, float]) -> None:
    """Reorder ``items`` in place: files by total expected seconds, descending (ties by path);
    each file's tests stay in their order."""
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[item.nodeid.split("::", 1)[0]].append(item)
    weight = {
        path: sum(known.get(i.nodeid, prior_s(i)) for i in tests) for path, tests in by_file.items()
    }
    order = sorted(by_file, key=lambda path: (-weight[path], path))
    items[:] = [item for path in order for item in by_file[path]]


class DurationRecorder:
    """Adds up each test's phases as the reports arrive (from the workers too, in the
    controller) and merges them into the cache at the end of the session."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += float(getattr(report, "duration", 0.0) or 0.0)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        cache = _cache(session.config)
        if cache is None or not self.seconds:
            return
        merged = {**known_durations(session.config)}
        merged.update({k: round(v, 3) for k, v in self.seconds.items()})
        cache.set(CACHE_KEY, merged)


def configure(config: pytest.Config) -> None:
    """Record durations in the process that sees every report: the controller, or a serial
    run's only process (not in xdist workers)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecorder(), "epd-durations")


def order(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Heaviest files first, in xdist workers (see the module docstring)."""
    if in_worker():
        heaviest_files_first(items, known_durations(config))
