"""``gpu_workers.compute.grid_values``: a grid's ``(t, h, w)`` as ints, or a clear refusal."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gpu_workers.compute import ComputeError, grid_row, grid_values, tokens_for_grid


@pytest.mark.parametrize(
    "grid",
    [
        torch.tensor([1, 4, 6]),
        torch.tensor([[1, 4, 6]]),
        torch.tensor([1, 4, 6], dtype=torch.int32),
        [1, 4, 6],
        (1, 4, 6),
    ],
)
def test_a_grid_of_three_positive_ints_in_any_form_reads_the_same(grid: Any) -> None:
    assert grid_values(grid) == (1, 4, 6)
    assert grid_row(grid).tolist() == [1, 4, 6] and grid_row(grid).dtype == torch.int64
    assert tokens_for_grid(grid, 2) == 6


@pytest.mark.parametrize(
    "grid",
    [
        torch.tensor([0, 4, 6]),
        torch.tensor([1, -4, 6]),
        torch.tensor([1, 4]),
        torch.tensor([[1, 4, 6], [1, 4, 6]]),
        [1, 4, 6, 1],
        [1, 0, 6],
    ],
)
def test_a_grid_that_is_not_three_positive_ints_is_refused_by_name(grid: Any) -> None:
    with pytest.raises(ComputeError, match=r"grid_thw must be three positive ints \(t, h, w\)"):
        grid_values(grid)


def test_a_grid_not_divisible_by_the_merge_size_is_refused() -> None:
    with pytest.raises(ComputeError, match="not divisible by merge size 2"):
        tokens_for_grid(torch.tensor([1, 3, 4]), 2)
