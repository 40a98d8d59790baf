"""Configuration from ``EPD_*`` environment variables (and CLI flags that override them)."""

from __future__ import annotations

import hashlib
import json
from functools import cache
from typing import Any, Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.families import MODEL_HELP


class Settings(BaseSettings):
    """Every knob of the pipeline. Read from the environment with the ``EPD_`` prefix."""

    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore")

    # Kafka
    kafka_bootstrap: str = Field("127.0.0.1:9092", description="bootstrap servers, comma separated")
    kafka_idempotence: bool = Field(
        True, description="idempotent producer; the embedded Tansu broker needs false"
    )
    kafka_session_timeout_ms: int = Field(
        10000, description="consumer group session timeout; Tansu holds a join for half of it"
    )
    kafka_heartbeat_interval_ms: int = 3000
    kafka_fetch_max_wait_ms: int = Field(
        500,
        description="longest a fetch waits for data; Kafka answers as soon as data arrives, "
        "Tansu only when the wait ends, so keep it short there",
    )
    topic_prefix: str = "epd"
    topic_partitions: int = 4
    max_message_bytes: int = Field(16 * 1024 * 1024, description="broker and producer message cap")
    compression: Literal["none", "gzip", "lz4", "zstd"] = Field(
        "none", description="producer compression for encoder inputs (pixels barely compress)"
    )
    prefill_compression: Literal["none", "gzip", "lz4", "zstd"] = Field(
        "gzip",
        description="compression of prefill events: their bytes are mostly runs of placeholder "
        "token ids, which gzip shrinks about tenfold",
    )

    # Redis (status records; also the default embedding store)
    redis_url: str = "redis://127.0.0.1:6379/0"
    status_ttl_s: int = 3600

    # Embedding store and claim checks
    store_url: str = Field("", description="embedding store URI; empty means EPD_REDIS_URL")
    embedding_ttl_s: int = 600
    embedding_wait_s: float = Field(
        60.0,
        description="longest a prefill worker waits for a request's embeddings (the request's "
        "deadline caps it)",
    )
    inline_limit_bytes: int = Field(
        256 * 1024, description="encoder inputs above this size travel as a TensorRef claim check"
    )

    # Safety
    ec_secret: SecretStr | None = Field(None, description="HMAC key for ec_transfer_params")
    ec_namespace: str = Field("ec", description="embedding keys must live under this prefix")
    validation_mode: Literal["strict", "vllm"] = "strict"
    spatial_merge_size: int = 2
    max_tensor_bytes: int = 256 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096

    # Model
    model: str = Field("tiny", description=MODEL_HELP)
    device: str = Field("auto", description="auto, cpu or cuda[:N]")

    # Consumers
    max_in_flight: int = 64
    max_attempts: int = 3
    encode_batch_patches: int = Field(16384, description="patch budget of one vision-tower call")

    @property
    def embedding_store_url(self) -> str:
        return self.store_url or self.redis_url

    def secret_bytes(self) -> bytes | None:
        return self.ec_secret.get_secret_value().encode() if self.ec_secret else None

    def to_env(self) -> dict[str, str]:
        """Every setting as the ``EPD_*`` variable that reproduces it in another process.

        Derived from the fields, so a new setting reaches spawned workers without a hand-kept
        list. Unset optional settings are left out (see :func:`env_names` to clear them).
        """
        env: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, bool):
                value = "true" if value else "false"
            elif not isinstance(value, str):
                value = json.dumps(value) if isinstance(value, list | dict) else str(value)
            env[env_name(name)] = value
        return env

    def describe(self) -> dict[str, Any]:
        """The settings as JSON-ready values; secrets appear as a SHA-256 digest, never in clear."""
        out = self.model_dump(mode="json")
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                digest = hashlib.sha256(value.get_secret_value().encode()).hexdigest()
                out[name] = f"sha256:{digest}"
        return out


def env_name(field: str) -> str:
    """The environment variable of a setting."""
    return f"EPD_{field.upper()}"


def env_names() -> set[str]:
    """The environment variables of every setting."""
    return {env_name(f) for f in Settings.model_fields}


@cache
def get_settings() -> Settings:
    """Settings read once per process from the environment."""
    return Settings()
