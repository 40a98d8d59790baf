"""``bench/gpu.py``: its CPU dry run (tiny sizes, fp32) runs every section and reports each one,
and without CUDA the plain run says it skipped (numbers are not judged); and the pieces whose
figures would only be wrong on a GPU, run here with stand-ins: the per-size memory peak, the
store leg the overhead uses, the reader's cold first get, a hung reader, the parity report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu, gpu_stores

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("parity", "encode", "stores", "overhead")


def _run(*args: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "bench/gpu.py", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_says_skipped(tmp_path: Path) -> None:
    done = _run(out=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"skipped": "no CUDA", "meets_budget": None}


def test_cpu_dry_run_reports_every_section(tmp_path: Path) -> None:
    done = _run("--cpu-dry-run", "--quick", out=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert json.loads((tmp_path / "gpu.json").read_text()) == doc  # $OUT/gpu.json, complete
    progress = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert [p["section"] for p in progress] == list(SECTIONS)  # printed as each one finished
    for name in SECTIONS:
        assert "error" not in doc[name], f"{name}: {doc[name]}"
    tiny = doc["parity"]["tiny"]
    assert len(tiny["generate_tokens"]) == tiny["steps"] == 16
    assert tiny["batched_matches_generate"] and tiny["separate_matches_generate"], tiny
    assert doc["parity"]["all_match"] is True and doc["parity"]["mismatches"] == []
    for side in ("56px", "112px"):
        assert doc["encode"][side]["batched_images_per_s"] > 0
    stores = doc["stores"]
    assert stores["cuda_same_process"]["get_p50_ms"] > 0 and stores["shm"]["put_p50_ms"] > 0
    assert "redis" in stores  # measured, or the reason it was skipped
    assert doc["overhead"]["gpu_ms"]["total"] > 0
    assert 0 < doc["overhead"]["with_cuda_store"]["share_of_gpu_compute"]


# --- figures that would only be wrong on a GPU ------------------------------------------------


def test_encode_peak_is_reset_before_each_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's peak is process-wide: each size must report its own, not the largest so far."""

    class Meter:
        peaks = iter([1.5, 2.5])

        def __init__(self, device: torch.device) -> None:
            self.peak = 99.0  # what the parity section's models left behind

        def reset(self) -> None:
            self.peak = next(self.peaks)

        def peak_gib(self) -> float:
            return self.peak

    monkeypatch.setattr(gpu, "PeakMemory", Meter)
    out = gpu.section_encode(gpu.profile(cpu_dry_run=True, quick=True))
    assert [out[f"{side}px"]["peak_mem_gib"] for side in (56, 112)] == [1.5, 2.5]


def test_peak_memory_resets_the_cuda_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: calls.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 3 * 2**30)
    meter = gpu.PeakMemory(torch.device("cuda", 0))
    meter.reset()
    assert calls == [("reset", torch.device("cuda", 0))] and meter.peak_gib() == 3.0
    assert gpu.PeakMemory(torch.device("cpu")).peak_gib() is None


def test_overhead_uses_the_same_process_leg_when_cross_process_failed() -> None:
    stores = {
        "cuda_cross_process": {"error": "RuntimeError: reader process failed"},
        "cuda_same_process": {"put_p50_ms": 0.5, "get_p50_ms": 0.25},
        "shm": {"put_p50_ms": 2.0, "get_p50_ms": 1.0},
        "redis": "skipped: redis-server is not on PATH",
    }
    out = gpu.section_overhead(gpu.profile(cpu_dry_run=True, quick=True), {"stores": stores}, 5.0)
    assert out["with_cuda_store"]["leg"] == "cuda_same_process"
    assert out["with_cuda_store"]["overhead_ms"] == 5.75
    assert out["with_shm_store"]["overhead_ms"] == 8.0 and "with_redis_store" not in out
    both = {**stores, "cuda_cross_process": {"get_p50_ms": 0.75}}
    shares = gpu.store_shares(both, 5.0, 100.0)
    assert shares["with_cuda_store"] == {  # the other process's get, with our put
        "leg": "cuda_cross_process", "overhead_ms": 6.25, "share_of_gpu_compute": 0.0625,
    }  # fmt: skip


class _Reader:
    """A store that logs what the reader asks of it; the first get would open the chunk."""

    def __init__(self) -> None:
        self.log: list[str] = []

    async def wait(self, keys: list[str], timeout_s: float) -> None:
        self.log.append("wait " + ",".join(keys))

    async def get(self, key: str) -> torch.Tensor:
        self.log.append(f"get {key}")
        return torch.ones(3)


async def test_reader_times_the_get_that_opens_the_chunk() -> None:
    store = _Reader()
    syncs: list[int] = []
    rep = await gpu_stores.read_times(store, 3, lambda: syncs.append(1))
    # nothing is read before the first timed get (ready shares emb's chunk: reading it first
    # would have opened the chunk outside the timer)
    assert store.log == ["wait ready", "get emb", "get emb", "get emb", "get ready"]
    assert len(rep["times"]) == 3 and rep["equal"] is True and len(syncs) == 6


async def test_a_reader_that_hangs_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    hang = [sys.executable, "-c", code, str(pid_file)]
    with pytest.raises(TimeoutError, match="killed"):
        await gpu_stores.run_child(hang, 1.0)
    with pytest.raises(ProcessLookupError):  # killed and reaped: no CUDA context left behind
        os.kill(int(pid_file.read_text()), 0)
    assert (await gpu_stores.run_child([sys.executable, "-c", "print(7)"], 30))[:2] == (0, b"7\n")


def _case(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "generate_tokens": [5, 6, 7, 8],
        "split_batched_tokens": [5, 6, 7, 8],
        "split_separate_tokens": [5, 6, 9, 9],
        "batched_matches_generate": True,
        "batched_first_divergent_step": None,
        "separate_matches_generate": False,
        "separate_first_divergent_step": 2,
        "embeddings_batched_vs_separate_max_abs_diff": 0.0078,
    }
    return base | kw


def test_parity_report_names_the_failed_comparison_and_where() -> None:
    summary = gpu.parity_summary({"tiny": _case(separate_matches_generate=True,
                                                split_separate_tokens=[5, 6, 7, 8]),
                                  "qwen2_vl_2b_sized": _case()})  # fmt: skip
    assert summary == {
        "all_match": False,
        "mismatches": [
            {
                "case": "qwen2_vl_2b_sized",
                "comparison": "separate_vs_generate",
                "what": gpu.COMPARISONS["separate"],
                "first_divergent_step": 2,
                "generate_token": 7,
                "split_token": 9,
                "embeddings_batched_vs_separate_max_abs_diff": 0.0078,
            }
        ],
    }
    short = _case(split_separate_tokens=[5, 6], separate_first_divergent_step=2)
    assert gpu.parity_summary({"c": short})["mismatches"][0]["split_token"] is None  # ran out
