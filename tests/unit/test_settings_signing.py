"""Workers that sign or verify ec_transfer_params refuse to start without a real secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import SecretStr

from runtime.settings import InsecureSettings, Settings

REAL = "3f9c1e0b7a6d4c2e8f1a0b9c7d6e5f4a"
ROOT = Path(__file__).resolve().parents[2]


def settings(secret: str | None, **kw: object) -> Settings:
    return Settings(ec_secret=SecretStr(secret) if secret is not None else None, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["encode", "prefill", "router"])
@pytest.mark.parametrize(
    ("secret", "why"),
    [
        (None, "not set"),
        ("", "not set"),
        ("change-me", "placeholder"),
        (" CHANGE-ME ", "placeholder"),
        ("short-secret", "fewer than 16"),
    ],
)
def test_signing_workers_refuse_without_a_real_secret(
    kind: str, secret: str | None, why: str
) -> None:
    with pytest.raises(InsecureSettings) as err:
        settings(secret).require_signing(kind)
    msg = str(err.value)
    assert why in msg and f"{kind} worker" in msg and "EPD_ALLOW_UNSIGNED=true" in msg
    assert isinstance(err.value, SystemExit)  # the process ends with the message, no traceback


@pytest.mark.parametrize("kind", ["encode", "prefill", "router"])
def test_a_real_secret_or_an_explicit_opt_out_runs(kind: str) -> None:
    settings(REAL).require_signing(kind)
    settings(None, allow_unsigned=True).require_signing(kind)
    settings("change-me", allow_unsigned=True).require_signing(kind)


def test_results_worker_needs_no_secret() -> None:
    settings(None).require_signing("results")


def test_allow_unsigned_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPD_EC_SECRET", raising=False)
    monkeypatch.setenv("EPD_ALLOW_UNSIGNED", "true")
    Settings().require_signing("prefill")
    monkeypatch.setenv("EPD_ALLOW_UNSIGNED", "false")
    with pytest.raises(InsecureSettings):
        Settings().require_signing("prefill")


def test_worker_command_exits_with_the_reason() -> None:
    # The real CLI, before it touches Kafka or loads a model: status 1, the rule on stderr.
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    env.update(EPD_EC_SECRET="change-me", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "epd.cli", "worker", "encode"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "refusing to start the encode worker" in done.stderr
    assert "Traceback" not in done.stderr


def test_compose_has_no_default_secret() -> None:
    # The stack used to default EPD_EC_SECRET to "change-me". Now Compose's `${VAR:?message}`
    # makes it refuse to start without one; the workers refuse placeholders on top.
    import re

    import yaml

    spec = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    workers = ("router", "encode", "prefill")
    for name in workers:
        value = spec["services"][name]["environment"]["EPD_EC_SECRET"]
        assert re.fullmatch(r"\$\{EPD_EC_SECRET:\?[^}]+\}", value), (name, value)
        assert spec["services"][name]["environment"].get("EPD_ALLOW_UNSIGNED") is None
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()


def test_spawned_workers_get_the_signing_and_bounds_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Local pipelines start workers as processes: what the parent was configured with must
    # reach them, or a worker refuses (no secret) or runs with other caps.
    from epd.local_pipeline import worker_env

    parent = settings(None, allow_unsigned=True, max_tokens_limit=7, max_context_tokens=99)
    for k in [k for k in os.environ if k.startswith("EPD_")]:
        monkeypatch.delenv(k)
    for k, v in worker_env(parent).items():
        monkeypatch.setenv(k, v)
    child = Settings()
    assert (child.allow_unsigned, child.max_tokens_limit, child.max_context_tokens) == (True, 7, 99)
    child.require_signing("prefill")
    signed = worker_env(settings(REAL, allow_unsigned=False))
    assert signed["EPD_EC_SECRET"] == REAL and signed["EPD_ALLOW_UNSIGNED"] == "false"
