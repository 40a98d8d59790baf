"""A broker in memory that delivers what stages publish to the stages that read it.

:class:`InMemoryBroker` is a :class:`~runtime.publisher.Publisher`: each record a stage sends is
framed as for Kafka (:func:`~runtime.publisher.frame`), kept, decoded again and handed to every
handler subscribed to its topic, each in a task of its own, as a consume loop would dispatch it.
So a whole request runs fan-out -> encode -> prefill in one process, with the real stage
handlers (the ones ``epd.stages`` builds), in a unit test: FastStream's ``TestKafkaBroker``.
What it does not do is what the consume loop does (commits, retries, the DLQ, partitions):
integration tests keep the real broker for those.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.publisher import InMemoryPublisher, SentRecord
from schemas.codec import get_codec
from schemas.types import Event

EventHandler = Callable[[Any], Awaitable[None]]


@dataclass
class InMemoryBroker(InMemoryPublisher):
    """Keeps every record (as :class:`InMemoryPublisher` does) and delivers it to subscribers."""

    handlers: dict[str, list[EventHandler]] = field(default_factory=dict)
    _running: set[asyncio.Task[None]] = field(default_factory=set)
    _failures: list[BaseException] = field(default_factory=list)

    def subscribe(self, topic: str, handler: EventHandler) -> None:
        """Deliver every later record of ``topic`` to ``handler`` (its decoded event)."""
        self.handlers.setdefault(topic, []).append(handler)

    async def send(
        self,
        topic: str,
        key: str | None,
        event: Event,
        *,
        headers: Sequence[tuple[str, bytes]] = (),
        value: bytes | None = None,
    ) -> int:
        size = await super().send(topic, key, event, headers=headers, value=value)
        record = self.records[-1]
        for handler in self.handlers.get(topic, ()):
            task = asyncio.create_task(self._deliver(handler, record))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
        return size

    async def _deliver(self, handler: EventHandler, record: SentRecord) -> None:
        try:
            # Decoded from the bytes, as a consumer gets it: what crosses is the wire format.
            await handler(get_codec().decode(record.value))
        except Exception as exc:  # kept for drain(): a handler's failure fails the test
            self._failures.append(exc)

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Until every delivery (and every record those deliveries published) is handled; the
        first handler failure is raised."""
        async with asyncio.timeout(timeout_s):
            while self._running:
                await asyncio.wait(set(self._running))
        if self._failures:
            raise self._failures[0]
