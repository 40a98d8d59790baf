"""Settings flow one way: a spawned worker sees every setting of the process that spawned it.

The worker environment is derived from the Settings model, so a setting added later reaches
workers without anyone extending a hand-kept list; this test fails if one does not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
from pydantic import SecretStr

from epd.local_pipeline import child_env, worker_env
from runtime.settings import Settings, env_name

VALIDATED = {
    # settings checked when Settings is built: a value of the right shape
    "store_url": "local://settings-flow",
    "kafka_bootstrap": "127.0.0.1:19092",
    "device": "cpu",
    "api_tokens": SecretStr("tok-settings-flow=flow-tenant"),
    "api_image_url_hosts": "images.example.com,127.0.0.1:8443",
    "served_model_name": "flow-model",
    "ready_stages": "router,results",
    "admin_tokens": SecretStr("tok-settings-admin=flow-admin"),
    "vllm_prefill_url": "http://vllm-p1:8000,http://vllm-p2:8000",
    "vllm_encode_url": "http://vllm-e:8000",
}


def _tokens_file() -> Path:
    fd, name = tempfile.mkstemp(prefix="epd-tokens-", text=True)
    with os.fdopen(fd, "w") as f:
        f.write("tok-from-file=file-tenant\n")
    return Path(name)


def _other_value(name: str, default: Any, annotation: Any) -> Any:
    """A valid value of the field's type that differs from its default."""
    if name in VALIDATED:
        return VALIDATED[name]
    args = typing.get_args(annotation)
    if Path in args or annotation is Path:
        return _tokens_file()
    if typing.get_origin(annotation) is Literal:
        return next(a for a in args if a != default)
    if SecretStr in args or annotation is SecretStr:
        return SecretStr(f"secret-for-{name}")
    if default is None and int in args:
        return 123_457  # an optional number left unset by default (derived when None)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 7
    if isinstance(default, float):
        return default + 0.25
    if isinstance(default, str):
        return f"{default}-{name}-x" if default else f"value-for-{name}"
    raise AssertionError(f"no non-default value for setting {name} ({annotation})")


def non_default_settings() -> Settings:
    values = {
        name: _other_value(name, field.default, field.annotation)
        for name, field in Settings.model_fields.items()
    }
    return Settings(**values)


def test_every_setting_gets_a_non_default_value() -> None:
    s = non_default_settings()
    default = Settings.model_construct()
    for name in Settings.model_fields:
        assert getattr(s, name) != getattr(default, name), name


def test_spawned_worker_sees_every_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    # A parent environment that disagrees with every setting: none of it may leak through.
    for name in Settings.model_fields:
        monkeypatch.setenv(env_name(name), "parent-value-that-must-not-win")
    s = non_default_settings()
    out = subprocess.run(
        [sys.executable, "-m", "epd.cli", "worker", "prefill", "--print-settings"],
        env=child_env(worker_env(s)),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    seen = json.loads(out.stdout)["settings"]
    expected = s.describe()
    assert set(seen) == set(expected) == set(Settings.model_fields)
    mismatched = {k: (expected[k], seen[k]) for k in expected if seen[k] != expected[k]}
    assert not mismatched


def test_unset_optional_setting_is_unset_in_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_EC_SECRET", "parent-secret")
    env = child_env(worker_env(Settings(ec_secret=None)))
    assert "EPD_EC_SECRET" not in env


def test_describe_never_shows_a_secret_in_clear() -> None:
    s = Settings(ec_secret=SecretStr("hunter2"))
    text = json.dumps(s.describe())
    assert "hunter2" not in text
    assert s.describe()["ec_secret"].startswith("sha256:")


@pytest.mark.parametrize(
    ("field", "url", "option"),
    [
        ("store_url", "redis://127.0.0.1:6379/0?max_connections=abc", "max_connections"),
        ("store_url", "redis://127.0.0.1:6379/0?max_connections=0", "max_connections"),
        ("store_url", "redis://127.0.0.1:6379/0?socket_timeout=soon", "socket_timeout"),
        ("store_url", "redis+cluster://h1:7000,h2:7001?max_connections=-3", "max_connections"),
        ("redis_url", "redis://127.0.0.1:6379/0?socket_connect_timeout=inf", "socket_connect"),
        ("redis_url", "redis+cluster://h1:7000?socket_timeout=nan", "socket_timeout"),
    ],
)
def test_a_redis_url_whose_numeric_option_would_not_apply_is_refused_naming_it(
    field: str, url: str, option: str
) -> None:
    with pytest.raises(ValueError, match=f"store URL option {option}") as info:
        Settings(**{field: url})
    assert field in str(info.value)


def test_a_redis_urls_numeric_options_that_apply_are_kept() -> None:
    url = "redis://127.0.0.1:6379/0?max_connections=5&socket_timeout=2.5"
    assert Settings(store_url=url).store_url == url
