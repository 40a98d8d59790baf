"""``bench/bare_costs.py``: the per-operation arithmetic, and the wake-up measurement run for
real (two processes, a pipe)."""

from __future__ import annotations

from bench import bare_costs


def test_per_unit_is_cpu_per_operation_in_the_unit_asked() -> None:
    assert bare_costs.per_unit(0.5, 1000) == 0.5  # ms
    assert bare_costs.per_unit(0.5, 1000, scale=1e6) == 500.0  # us
    assert bare_costs.per_unit(0.25, 0) == 250.0  # no operation counts as one: no division by 0


def test_a_wakeup_round_trip_costs_cpu_on_both_sides() -> None:
    got = bare_costs.wakeup_cpu(2000)  # returns once the other process has exited
    assert got["round_trips"] == 2000
    # Both sides take turns, so their CPU is some, and never more than two cores' worth of
    # the wall time (/proc's 10 ms ticks on ~0.1 s: a margin).
    assert 0 < got["cpu_us"] < 3 * got["wall_us"], got
