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

from runtime.tracing import current_carrier
from schemas.codec import SCHEMA_HEADER, get_codec
from schemas.topics import Topics
from schemas.types import Event

Headers = list[tuple[str, bytes]]


def event_headers(event: Event) -> Headers:
    """Kafka headers for a framed event: the schema name travels beside the fingerprint."""
    return [(SCHEMA_HEADER, get_codec().schema_name(event).encode())]


@dataclass(frozen=True, slots=True)
class Frame:
    """One record as it leaves a process: key, value and headers."""

    key: bytes | None
    value: bytes
    headers: Headers


def frame(
    event: Event,
    key: str | bytes | None,
    *,
    headers: Sequence[tuple[str, bytes]] = (),
    value: bytes | None = None,
) -> Frame:
    """The one framing of every event a process sends: the Avro single-object value, the schema
    name header, the active trace context as W3C headers (beside the event's own trace map),
    then ``headers``. Every publisher, real or in memory, and the DLQ frame through this. A
    ``bytes`` key is sent as it is (a dead letter keeps its original record's key). ``value``:
    the event's encoding when the caller made it already (the fan-out encodes each event once,
    to check it before anything is sent, and sends those bytes)."""
    trace = [(k, v.encode()) for k, v in current_carrier().items()]
    return Frame(
        key.encode() if isinstance(key, str) else key,
        get_codec().encode(event) if value is None else value,
        [*event_headers(event), *trace, *headers],
    )


OutRecord = tuple[str | None, Event, Sequence[tuple[str, bytes]]]
"""One record for :meth:`Publisher.send_all`: its key, its event and its headers."""


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
        value: bytes | None = None,
    ) -> int:
        """Encode ``event`` (or take ``value``, its encoding made before), send it keyed by
        ``key`` and return the encoded value's size."""
        ...

    async def send_all(self, topic: str, records: Sequence[OutRecord]) -> None:
        """Send ``records`` to ``topic`` in their order and return once the broker has
        acknowledged every one (the sends overlap: one wait for all the acknowledgements)."""
        ...


async def publish(
    publisher: Publisher,
    topics: Topics,
    event: Event,
    *,
    headers: Sequence[tuple[str, bytes]] = (),
    value: bytes | None = None,
) -> int:
    """Send ``event`` to the topic its type goes to, keyed as the channel table says
    (:meth:`schemas.topics.Topics.route`): no send site picks a key of its own. ``value``: its
    encoding, when made before."""
    topic, key = topics.route(event)
    if value is None:
        return await publisher.send(topic, key, event, headers=headers)
    return await publisher.send(topic, key, event, headers=headers, value=value)


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
        value: bytes | None = None,
    ) -> int:
        record = frame(event, key, headers=headers, value=value)
        self.records.append(SentRecord(topic, key, record.value, record.headers))
        return len(record.value)

    async def send_all(self, topic: str, records: Sequence[OutRecord]) -> None:
        for key, event, headers in records:
            await self.send(topic, key, event, headers=headers)

    def on(self, topic: str) -> list[SentRecord]:
        """The records sent to ``topic``, in send order."""
        return [r for r in self.records if r.topic == topic]

    def events(self, topic: str) -> list[Event]:
        """The decoded events sent to ``topic``, in send order."""
        return [r.event() for r in self.on(topic)]
