"""The seam between stage logic and the broker: publish one framed event to a topic with a key.

Stages (fan-out, encode, prefill, reporters) only ever *send* events, so they depend on this small
protocol instead of an ``AIOKafkaProducer``. ``runtime.kafka.KafkaPublisher`` is the real one;
:class:`InMemoryPublisher` records what would have been sent, so stage logic has fast unit tests
without a broker (the idea of FastStream's ``TestKafkaBroker``). Integration and end-to-end tests
keep using the real broker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from schemas.codec import SCHEMA_HEADER, get_codec
from schemas.types import Event

Headers = list[tuple[str, bytes]]


def event_headers(event: Event) -> Headers:
    """Kafka headers for a framed event: the schema name travels beside the fingerprint."""
    return [(SCHEMA_HEADER, get_codec().schema_name(event).encode())]


@runtime_checkable
class Publisher(Protocol):
    """Sends framed events; ``send`` returns once the broker has acknowledged the record."""

    async def send(
        self,
        topic: str,
        key: str | None,
        event: Event,
        *,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> int:
        """Encode ``event``, send it keyed by ``key`` and return the encoded value's size."""
        ...


@dataclass(frozen=True, slots=True)
class SentRecord:
    """One record an :class:`InMemoryPublisher` accepted."""

    topic: str
    key: str | None
    value: bytes
    headers: Headers

    def event(self) -> Event:
        """The record decoded again (proves it survives the wire format)."""
        return get_codec().decode(self.value)


@dataclass
class InMemoryPublisher:
    """A Publisher that keeps every record in a list, encoded exactly as Kafka would get it."""

    records: list[SentRecord] = field(default_factory=list)

    async def send(
        self,
        topic: str,
        key: str | None,
        event: Event,
        *,
        headers: Sequence[tuple[str, bytes]] = (),
    ) -> int:
        value = get_codec().encode(event)
        self.records.append(SentRecord(topic, key, value, [*event_headers(event), *headers]))
        return len(value)

    def on(self, topic: str) -> list[SentRecord]:
        """The records sent to ``topic``, in send order."""
        return [r for r in self.records if r.topic == topic]

    def events(self, topic: str) -> list[Event]:
        """The decoded events sent to ``topic``, in send order."""
        return [r.event() for r in self.on(topic)]
