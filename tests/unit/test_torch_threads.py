"""``runtime.torch_threads``: one torch thread where no model computes on the CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.settings import Settings
from runtime.torch_threads import computes_on_cpu, torch_threads


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


def _in_child(code: str) -> str:
    """What ``code`` prints, run in a child: torch's thread count is process-wide, and this
    test process keeps its own."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def test_apply_sets_the_processs_threads() -> None:
    code = (
        "import torch\n"
        "from runtime.settings import Settings\n"
        "from runtime.torch_threads import apply_torch_threads\n"
        "torch.set_num_threads(2)\n"
        "print(apply_torch_threads(Settings(), model_on_cpu=False), torch.get_num_threads())\n"
        "print(apply_torch_threads(Settings(), model_on_cpu=True))\n"
        "print(apply_torch_threads(Settings(torch_threads=2), model_on_cpu=False))\n"
    )
    assert _in_child(code).split("\n")[:3] == ["1 1", "1", "2"]


def test_only_a_model_with_weights_on_a_cpu_computes_on_the_cpu() -> None:
    assert computes_on_cpu(Settings(model="tiny", device="cpu"))
    assert not computes_on_cpu(Settings(model="instant", device="cpu"))
    assert not computes_on_cpu(Settings(model="tiny", device="cpu", engine="vllm"))


def test_only_the_stages_that_run_the_model_set_threads() -> None:
    from epd.stages import STAGES

    assert {k for k, s in STAGES.items() if s.computes} == {"encode", "prefill", "decode"}


def test_a_process_serving_the_api_takes_one_thread_a_test_app_leaves_it() -> None:
    code = (
        "import torch\n"
        "from frontend.api import create_app, process_app\n"
        "from runtime.settings import Settings\n"
        "torch.set_num_threads(2)\n"
        "create_app(Settings())\n"
        "print(torch.get_num_threads())\n"
        "process_app(Settings())\n"
        "print(torch.get_num_threads())\n"
    )
    assert _in_child(code).split() == ["2", "1"]
