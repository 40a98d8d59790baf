"""The channel table: every topic of the pipeline, the event it carries, its key and its reader.

One row per topic, the one home of these facts: the topic's name under the prefix, the event
type its records hold (the DLQ replays by it), the event field a record is keyed by (so a sender
never chooses a key of its own: repeats of one image share an encode partition, a request's
updates stay in order on the results topic), and the stage whose consumer group reads it (the
worker command's stage table subscribes by it). :class:`Topics` applies the table to a prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from schemas.types import (
    DeadLetter,
    DecodeEvent,
    EncodedEvent,
    EncodeEvent,
    Event,
    PrefillEvent,
    RenderEvent,
    ResultEvent,
)


@dataclass(frozen=True, slots=True)
class Channel:
    """One topic: ``{prefix}.{name}`` carrying ``event`` keyed by its field ``key`` (None: the
    sender passes the key through, as the DLQ keeps the original record's), read by the groups
    of ``readers``."""

    name: str
    event: type[Any]
    key: str | None
    readers: tuple[str, ...]
    doc: str


CHANNELS: tuple[Channel, ...] = (
    Channel("render", RenderEvent, "request_id", ("router",), "RenderEvents of external renderers"),
    Channel("encode", EncodeEvent, "mm_hash", ("encode",), "one item's encoder inputs"),
    Channel("prefill", PrefillEvent, "request_id", ("prefill",), "metadata-only prefill events"),
    Channel(
        "decode", DecodeEvent, "request_id", ("decode",), "prefilled requests for decode workers"
    ),
    Channel("encoded", EncodedEvent, "mm_hash", ("results",), "one EncodedEvent per item"),
    Channel("results", ResultEvent, "request_id", ("results",), "every stage's status updates"),
    Channel("dlq", DeadLetter, None, (), "dead letters, keyed by their original record's key"),
)
"""Every topic of one pipeline, in the order ``Topics.all`` lists them."""

STAGE_NAMES: tuple[str, ...] = tuple(dict.fromkeys(r for c in CHANNELS for r in c.readers))
"""Every stage that reads a topic (a worker kind): router, encode, prefill, decode, results."""

_BY_NAME = {c.name: c for c in CHANNELS}
_BY_EVENT = {c.event: c for c in CHANNELS}


@dataclass(frozen=True, slots=True)
class Topics:
    """The channel table under one prefix: topic names, routes and consumer groups."""

    prefix: str = "epd"

    def topic(self, name: str) -> str:
        """``{prefix}.{name}`` of the channel called ``name`` (KeyError for an unknown one)."""
        return f"{self.prefix}.{_BY_NAME[name].name}"

    @property
    def render(self) -> str:
        return self.topic("render")

    @property
    def encode(self) -> str:
        return self.topic("encode")

    @property
    def prefill(self) -> str:
        return self.topic("prefill")

    @property
    def decode(self) -> str:
        """Requests handed from prefill workers to decode workers (the optional decode stage)."""
        return self.topic("decode")

    @property
    def encoded(self) -> str:
        return self.topic("encoded")

    @property
    def results(self) -> str:
        return self.topic("results")

    @property
    def dlq(self) -> str:
        return self.topic("dlq")

    def all(self) -> list[str]:
        """Every topic, in table order."""
        return [self.topic(c.name) for c in CHANNELS]

    def route(self, event: Event) -> tuple[str, str]:
        """The topic ``event`` goes to and the key it is sent with (by its channel's row)."""
        channel = _BY_EVENT.get(type(event))
        if channel is None or channel.key is None:
            raise ValueError(f"no channel routes {type(event).__name__} by its own fields")
        return self.topic(channel.name), str(getattr(event, channel.key))

    def event_type(self, topic: str) -> type[Any] | None:
        """The event type records of ``topic`` hold (None: not one of this prefix's topics)."""
        name = topic.removeprefix(f"{self.prefix}.")
        channel = _BY_NAME.get(name) if name != topic else None
        return channel.event if channel is not None else None

    def read_by(self, stage: str) -> list[str]:
        """The topics the consumer group of ``stage`` reads, in table order."""
        return [self.topic(c.name) for c in CHANNELS if stage in c.readers]

    def keyed_by_request(self, topic: str) -> bool:
        """Whether records of ``topic`` are keyed by their request id."""
        name = topic.removeprefix(f"{self.prefix}.")
        channel = _BY_NAME.get(name)
        return channel is not None and channel.key == "request_id"

    def group(self, stage: str) -> str:
        """Consumer group of a stage, e.g. ``epd-encode``. The prefix is part of it, so two
        pipelines sharing one broker never join each other's groups (a shared group would
        rebalance across both on every join)."""
        return f"{self.prefix}-{stage}"
