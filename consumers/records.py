"""One consumed record as a handler sees it, and the handler types a consume loop runs."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from schemas.types import ErrorInfo

__all__ = ["ConsumedEvent", "DeadLetterHook", "Handler", "consumed_event"]


@dataclass(slots=True)
class ConsumedEvent:
    """One record as a handler sees it. ``event`` is None only for undecodable records (DLQ)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: dict[str, bytes]
    value: bytes
    event: Any
    timestamp_ms: int = -1
    attempt: int = 1
    """1 on the first try, 2 on the first retry, ..."""

    @property
    def key_str(self) -> str | None:
        """The key decoded as UTF-8 (request ids and mm hashes are text)."""
        return self.key.decode("utf-8", "replace") if self.key is not None else None


Handler = Callable[[ConsumedEvent], Awaitable[None]]
DeadLetterHook = Callable[[ConsumedEvent, ErrorInfo], Awaitable[None]]


def consumed_event(rec: Any) -> ConsumedEvent:
    """A fetched ``ConsumerRecord`` as a not yet decoded :class:`ConsumedEvent` (absent headers
    and values read as empty bytes)."""
    return ConsumedEvent(
        topic=rec.topic,
        partition=rec.partition,
        offset=rec.offset,
        key=rec.key,
        headers={k: bytes(v) if v is not None else b"" for k, v in (rec.headers or ())},
        value=rec.value if rec.value is not None else b"",
        event=None,
        timestamp_ms=rec.timestamp,
    )
