"""What a lent GPU will run, tried on the CPU: ``bench/gpu_device.sh prepare`` (fetch the
device's missing wheels, dry-run the device step, print the call), and ``bench/gpu.py
--cpu-dry-run`` under the device image's transformers (5.17, older than this checkout's), in a
side environment: a ``pip --target`` folder with only that transformers and the requirements
of it this environment does not meet, put first on PYTHONPATH (torch and the rest are reused).

Both need a package registry the first time; they skip, saying why, only when pip cannot fetch
there. The side folder is cached under ``~/.cache/epd/side-env`` (``EPD_SIDE_ENV_CACHE``), keyed
by the transformers version and this Python's.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = ("parity", "encode", "stores", "overhead")
DEVICE_TRANSFORMERS = "5.17.0"
"""transformers in the lent device's image (torch 2.11 + CUDA 13, Python 3.12)."""
SIDE_CACHE = Path(os.environ.get("EPD_SIDE_ENV_CACHE", Path.home() / ".cache" / "epd" / "side-env"))


def _sections_ran(doc: dict[str, object]) -> None:
    for name in SECTIONS:
        block = doc[name]
        assert isinstance(block, dict) and "error" not in block, f"{name}: {block}"


# --- bench/gpu_device.sh -----------------------------------------------------------------------


@pytest.mark.slow
def test_prepare_fetches_the_wheels_dry_runs_the_device_step_and_prints_the_call(
    tmp_path: Path,
) -> None:
    out, wheels = tmp_path / "out", tmp_path / "wheels"
    env = {**os.environ, "OUT": str(out), "EPD_DEVICE_WHEELS": str(wheels)}
    env["EPD_PYTHON"] = sys.executable
    done = subprocess.run(
        ["bash", "bench/gpu_device.sh", "prepare"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode == 3 and "pip download could not fetch" in done.stderr:
        pytest.skip(f"no package registry reachable: {done.stderr.strip()[-500:]}")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]  # stdout: pytest's tail
    call = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert call["command"] == "bash bench/gpu_device.sh run" and len(call["command"]) <= 2000
    assert call["carry"] == [str(wheels)] and 0 < call["timeout_s"] <= 600
    names = sorted(p.name for p in wheels.iterdir())
    assert any(n.startswith("blake3-") and "-cp312-" in n and "x86_64" in n for n in names), names
    doc = json.loads((out / "gpu.json").read_text())
    assert doc["cpu_dry_run"] is True
    _sections_ran(doc)
    assert "passed" in (out / "pytest.log").read_text()  # the CUDA store tests ran (on CPU here)
    assert "transformers" in (out / "env.txt").read_text()


def test_run_names_a_missing_module_and_stops(tmp_path: Path) -> None:
    """A device lacking a module, with no wheel of it carried: the run stops before the
    benchmark, naming the module and what needs it."""
    site = tmp_path / "site"  # first on PYTHONPATH there: here it hides this env's blake3
    site.mkdir()
    (site / "blake3.py").write_text("raise ModuleNotFoundError('no blake3', name='blake3')\n")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "EPD_DEVICE_SITE": str(site)}
    env |= {"EPD_DEVICE_WHEELS": str(tmp_path / "none"), "EPD_DEVICE_PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", "bench/gpu_device.sh", "run", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr[-2000:]
    assert "missing here: blake3, and no carried wheel of blake3" in done.stderr
    assert "MISSING module 'blake3' (needed by blake3)" in done.stdout
    assert not (tmp_path / "out" / "gpu.json").exists()  # the benchmark never started


def test_run_needs_out() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(
        ["bash", "bench/gpu_device.sh", "run", "--dry-run"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "set OUT" in done.stderr


# --- bench/gpu.py --cpu-dry-run under the device's transformers --------------------------------


class _CannotInstall(Exception):
    pass


def _pip_target(target: Path, specs: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         "--no-deps", "--only-binary=:all:", "--target", str(target), *specs],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise _CannotInstall(f"pip install {' '.join(specs)}: {done.stderr.strip()[-800:]}")


def _unmet(target: Path) -> list[str]:
    """Requirements of the distributions in ``target`` that neither it nor this environment
    meets (as ``name<specifier>``)."""
    dists = list(md.distributions(path=[str(target)]))
    here = {canonicalize_name(d.metadata["Name"]): d.version for d in dists}
    unmet: set[str] = set()
    for dist in dists:
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = here.get(canonicalize_name(req.name))
            if have is None:
                try:
                    have = md.version(req.name)
                except md.PackageNotFoundError:
                    have = None
            if have is None or not req.specifier.contains(have, prereleases=True):
                unmet.add(f"{req.name}{req.specifier}")
    return sorted(unmet)


def side_site(version: str) -> Path:
    """The cached --target folder for transformers ``version`` (built on first use)."""
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    site = SIDE_CACHE / f"transformers-{version}-{py}"
    if (site / ".complete").exists():
        return site
    build = site.with_name(f"{site.name}.build-{os.getpid()}")
    shutil.rmtree(build, ignore_errors=True)
    try:
        _pip_target(build, [f"transformers=={version}"])
        for _ in range(4):  # its unmet requirements, then theirs
            unmet = _unmet(build)
            if not unmet:
                break
            _pip_target(build, unmet)
        else:
            raise AssertionError(f"requirements still unmet in {build}: {_unmet(build)}")
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    (build / ".complete").touch()
    try:
        build.rename(site)
    except OSError:  # another run finished first: use its folder
        shutil.rmtree(build, ignore_errors=True)
    return site


@pytest.mark.slow
def test_cpu_dry_run_passes_with_the_devices_transformers(tmp_path: Path) -> None:
    try:
        site = side_site(DEVICE_TRANSFORMERS)
    except _CannotInstall as exc:
        pytest.skip(f"transformers {DEVICE_TRANSFORMERS} cannot be installed here: {exc}")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "OUT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--cpu-dry-run", "--quick"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(done.stdout)
    assert doc["machine"]["transformers"] == DEVICE_TRANSFORMERS  # the side one was imported
    _sections_ran(doc)
    assert doc["parity"]["all_match"] is True, doc["parity"]["mismatches"]
