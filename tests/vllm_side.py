"""vLLM 0.33.0's own code for the tests that hold us to it (``tools/vllm-side.sh`` assembles
it: the wheel's Python files and the few pure-Python imports this environment lacks).

:func:`use_vllm` puts that folder at the *end* of ``sys.path`` (our packages and this
environment's torch, transformers and pydantic win) and returns, or skips the module saying how
to get it; under ``CI=true`` a missing side folder fails instead (CI builds it first).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "vllm-side.sh"
VLLM_VERSION = "0.33.0"


def side_paths() -> list[str] | None:
    """The side folder's entries (``EPD_VLLM_SIDE`` first, else the script's cache when it is
    complete), or None. Never downloads: ``tools/vllm-side.sh`` does."""
    given = os.environ.get("EPD_VLLM_SIDE")
    if given:
        return [p for p in given.split(os.pathsep) if p]
    cache = Path(os.environ.get("EPD_SIDE_ENV_CACHE", Path.home() / ".cache/epd/side-env"))
    folder = cache / f"vllm-{VLLM_VERSION}-py{sys.version_info[0]}{sys.version_info[1]}"
    if not (folder / ".complete").exists():
        return None
    return [str(folder / "wheel"), str(folder / "deps")]


def use_vllm() -> None:
    """Make ``import vllm`` find vLLM 0.33.0's code, or skip (fail under CI) saying why."""
    paths = side_paths()
    if paths is None:
        _missing(
            f"vLLM {VLLM_VERSION}'s code is not assembled here: run {SCRIPT.relative_to(ROOT)}"
        )
        return
    for p in paths:
        if p not in sys.path:
            sys.path.append(p)
    try:
        import vllm  # noqa: F401
        from vllm.entrypoints.scale_out.token_in_token_out import protocol  # noqa: F401
    except Exception as exc:
        _missing(f"vLLM {VLLM_VERSION} does not import from {paths}: {exc!r}")


def _missing(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"{why} (CI must run the vLLM contract tests)", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def side_env() -> dict[str, str]:
    """The environment of a subprocess that imports vLLM (``PYTHONPATH``: ours, then vLLM's)."""
    paths = side_paths() or []
    current = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), current, *paths]).strip(":")}
