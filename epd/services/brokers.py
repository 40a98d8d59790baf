"""Which embedded broker to run, and starting it: Apache Kafka (from jars) or Tansu."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epd.services import kafka, tansu
from epd.services.config import BrokerChoice, LocalServices
from epd.services.state import ServiceError, ServiceRecord

BROKERS = ("apache", "tansu")
TANSU_TRANSACTIONS = (
    "EPD_KAFKA_TRANSACTIONS=true needs a broker with transactions, and the broker here is Tansu "
    "(it answers InitProducerId with UnknownError); run Apache Kafka instead (EPD_BROKER=apache, "
    "or EPD_KAFKA_BOOTSTRAP pointing at a Kafka cluster) or unset EPD_KAFKA_TRANSACTIONS"
)


def choose_broker(choice: BrokerChoice | None = None) -> tuple[str, str | None]:
    """``(kind, why)`` for ``choice`` (default ``EPD_BROKER``): ``auto`` is Apache Kafka when this
    machine can run it, else Tansu, and ``why`` then says what Apache Kafka lacked."""
    picked = choice or LocalServices().broker
    if picked != "auto":
        return picked, None
    reason = kafka.unavailable_reason()
    return ("tansu", f"Apache Kafka cannot run here: {reason}") if reason else ("apache", None)


def describe(kind: str) -> str:
    """The broker's name and version, for headers and logs (``Apache Kafka 4.4.0``)."""
    return f"Apache Kafka {kafka.KAFKA_VERSION}" if kind == "apache" else f"Tansu {tansu.version()}"


def start_broker(kind: str, directory: Path, **kwargs: Any) -> ServiceRecord:
    """Start the embedded broker of ``kind`` under ``directory``; ``fresh`` (Apache Kafka only)
    wipes its data first (Tansu always starts empty)."""
    if kind == "apache":
        return kafka.start_apache_kafka(directory, **kwargs)
    if kind == "tansu":
        kwargs.pop("fresh", None)
        return tansu.start_tansu(directory, **kwargs)
    raise ServiceError(f"unknown broker {kind!r}: choose one of {', '.join(BROKERS)}")
