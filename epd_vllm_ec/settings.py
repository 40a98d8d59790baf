"""The connector's settings, read from vLLM's ``ec_connector_extra_config``.

The secret is never written inline in vLLM's command line (which ``ps`` and vLLM's own config
log show): the extra config names the environment variable that holds it (``secret_env``,
``EPD_EC_SECRET`` by default, the variable our workers read).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from runtime.settings import MIN_SECRET_CHARS, PLACEHOLDER_SECRETS
from schemas import defaults
from schemas.ec_entries import without_credentials

CONNECTOR_STORE_SCHEMES = ("redis", "rediss", "redis+cluster", "shm")
"""Stores a second process can read: ``local://`` lives in one process and ``cuda://`` hands
out device memory, neither of which a vLLM instance on another host can reach."""

DEFAULT_SECRET_ENV = "EPD_EC_SECRET"
DEFAULT_MAX_ITEM_BYTES = defaults.MAX_TENSOR_BYTES
DEFAULT_IO_TIMEOUT_S = 30.0

KNOWN_KEYS = frozenset(
    {
        "store_url",
        "namespace",
        "model_fingerprint",
        "secret_env",
        "ttl_s",
        "max_item_bytes",
        "io_timeout_s",
        "deepstack_levels",
    }
)


class ConnectorConfigError(ValueError):
    """The connector's extra config (or the secret it names) is unusable; the message says
    which key and how to fix it."""


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """What the connector needs, checked."""

    store_url: str
    model_fingerprint: str
    secret: bytes
    namespace: str = defaults.EC_NAMESPACE
    ttl_s: float = float(defaults.EMBEDDING_TTL_S)
    max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES
    io_timeout_s: float = DEFAULT_IO_TIMEOUT_S
    deepstack_levels: int | None = None
    """Qwen3-VL deepstack levels in vLLM's encoder output (None: read from the model config)."""


def connector_settings(
    extra: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ConnectorSettings:
    """Settings from ``ec_connector_extra_config``; :class:`ConnectorConfigError` names the
    first bad key (an unknown key too: a typo must not silently fall back to a default)."""
    env = os.environ if environ is None else environ
    unknown = sorted(set(extra) - KNOWN_KEYS)
    if "secret" in unknown:
        raise ConnectorConfigError(
            "the secret is never written inline: name the variable that holds it in secret_env"
        )
    if unknown:
        raise ConnectorConfigError(
            f"unknown ec_connector_extra_config key(s) {unknown}; known: {sorted(KNOWN_KEYS)}"
        )
    store_url = _required_str(extra, "store_url")
    scheme = urlsplit(store_url).scheme
    if scheme not in CONNECTOR_STORE_SCHEMES:
        raise ConnectorConfigError(
            f"store_url {without_credentials(store_url)!r}: the connector needs a store another "
            f"process can read: {', '.join(s + '://' for s in CONNECTOR_STORE_SCHEMES)}"
        )
    fingerprint = _required_str(extra, "model_fingerprint")
    namespace = _optional_str(extra, "namespace", defaults.EC_NAMESPACE)
    for name, value in (("model_fingerprint", fingerprint), ("namespace", namespace)):
        if ":" in value:
            raise ConnectorConfigError(f"{name} {value!r} must not hold ':' (keys are split on it)")
    return ConnectorSettings(
        store_url=store_url,
        model_fingerprint=fingerprint,
        secret=_secret(extra, env),
        namespace=namespace,
        ttl_s=_positive(extra, "ttl_s", float(defaults.EMBEDDING_TTL_S)),
        max_item_bytes=int(_positive(extra, "max_item_bytes", DEFAULT_MAX_ITEM_BYTES)),
        io_timeout_s=_positive(extra, "io_timeout_s", DEFAULT_IO_TIMEOUT_S),
        deepstack_levels=_levels(extra),
    )


def _required_str(extra: Mapping[str, Any], name: str) -> str:
    value = extra.get(name)
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(f"ec_connector_extra_config needs {name!r} (a non-empty string)")
    return value


def _optional_str(extra: Mapping[str, Any], name: str, default: str) -> str:
    if name not in extra:
        return default
    return _required_str(extra, name)


def _positive(extra: Mapping[str, Any], name: str, default: float) -> float:
    value = extra.get(name, default)
    # bool is an int: "ttl_s": true is a mistake, not 1 second.
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConnectorConfigError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def _levels(extra: Mapping[str, Any]) -> int | None:
    value = extra.get("deepstack_levels")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConnectorConfigError(f"deepstack_levels must be an integer >= 0, got {value!r}")
    return value


def _secret(extra: Mapping[str, Any], env: Mapping[str, str]) -> bytes:
    var = _optional_str(extra, "secret_env", DEFAULT_SECRET_ENV)
    value = env.get(var, "")
    if not value:
        # Unsigned entries would let any request point this instance at any key of the store.
        raise ConnectorConfigError(
            f"the EC connector signs and verifies ec_transfer_params entries: set {var} to the "
            "secret the encode and prefill sides share"
        )
    # The same floor our own processes hold the secret to (runtime.settings.require_signing).
    if value.strip().lower() in PLACEHOLDER_SECRETS or len(value) < MIN_SECRET_CHARS:
        raise ConnectorConfigError(
            f"{var} is a placeholder or shorter than {MIN_SECRET_CHARS} characters: give the "
            "random secret the encode and prefill sides share"
        )
    return value.encode()
