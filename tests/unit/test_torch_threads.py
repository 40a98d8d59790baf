"""``runtime.torch_threads``: one torch thread where no model computes on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.settings import Settings
from runtime.torch_threads import torch_threads


def test_a_process_without_cpu_model_compute_gets_one_thread() -> None:
    assert torch_threads(Settings(), model_on_cpu=False) == 1


def test_a_model_on_the_cpu_keeps_torchs_default() -> None:
    assert torch_threads(Settings(), model_on_cpu=True) is None


@pytest.mark.parametrize("model_on_cpu", [True, False])
def test_the_setting_wins_either_way(model_on_cpu: bool) -> None:
    assert torch_threads(Settings(torch_threads=3), model_on_cpu=model_on_cpu) == 3


def test_a_count_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="torch_threads"):
        Settings(torch_threads=0)


def test_apply_sets_the_processs_threads() -> None:
    # In a child: the count is process-wide, and this test process keeps its own.
    code = (
        "import torch\n"
        "from runtime.settings import Settings\n"
        "from runtime.torch_threads import apply_torch_threads\n"
        "torch.set_num_threads(2)\n"
        "print(apply_torch_threads(Settings(), model_on_cpu=False), torch.get_num_threads())\n"
        "print(apply_torch_threads(Settings(), model_on_cpu=True))\n"
        "print(apply_torch_threads(Settings(torch_threads=2), model_on_cpu=False))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    assert out[:3] == ["1 1", "1", "2"]
