"""Configuration from ``EPD_*`` environment variables (and CLI flags that override them)."""

from __future__ import annotations

from functools import cache
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    group_suffix: str = Field(
        "",
        description="appended to every consumer group id; isolates runs that share a broker "
        "(groups are per broker, not per topic prefix)",
    )
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
    model: str = Field("tiny", description="'tiny' or a local checkpoint path")
    device: str = Field("auto", description="auto, cpu or cuda[:N]")

    # Consumers
    max_in_flight: int = 64
    max_attempts: int = 3
    encode_batch_patches: int = Field(16384, description="patch budget of one vision-tower call")

    # HTTP API (epd api)
    api_tokens: SecretStr | None = Field(
        None,
        description="bearer tokens, 'TOKEN=TENANT' pairs separated by commas; unset: open API",
    )
    api_max_body_bytes: int = Field(
        32 * 1024 * 1024, description="largest request body; checked while it is read"
    )
    api_max_image_bytes: int = Field(
        16 * 1024 * 1024, description="largest encoded image (file bytes, before decoding)"
    )
    api_max_images: int = Field(16, description="images per request")
    api_max_in_flight: int = Field(
        256, description="admitted, unfinished requests across all API replicas; beyond: 429"
    )
    api_max_encode_lag: int = Field(
        10000, description="encode topic consumer lag (events) beyond which the API answers 429"
    )
    api_render_concurrency: int = Field(2, description="renders running at once per process")
    api_idempotency_ttl_s: int = Field(86400, description="lifetime of an Idempotency-Key")
    api_max_wait_s: float = Field(60.0, description="longest ?wait= long-poll")
    api_retry_after_s: int = Field(1, description="Retry-After of 429 and 503 answers")

    @property
    def embedding_store_url(self) -> str:
        return self.store_url or self.redis_url

    def api_tenants(self) -> dict[str, str]:
        """Bearer token -> tenant, from ``api_tokens`` (``TOKEN=TENANT,TOKEN2=TENANT2``)."""
        if self.api_tokens is None:
            return {}
        out: dict[str, str] = {}
        for pair in self.api_tokens.get_secret_value().split(","):
            pair = pair.strip()
            if not pair:
                continue
            token, sep, tenant = pair.partition("=")
            if not sep or not token.strip() or not tenant.strip():
                raise ValueError("EPD_API_TOKENS: each entry must be TOKEN=TENANT")
            out[token.strip()] = tenant.strip()
        return out

    def secret_bytes(self) -> bytes | None:
        return self.ec_secret.get_secret_value().encode() if self.ec_secret else None


@cache
def get_settings() -> Settings:
    """Settings read once per process from the environment."""
    return Settings()
