"""The dead-letter envelope: the record a consumer publishes for an event it gave up on, and the
headers that travel with it. Written by the consume loop, read by ``epd dlq``: one home.

A :class:`~schemas.types.DeadLetter` keeps the original record whole (topic, partition, offset,
key, value, headers) beside the error and the attempts. The same facts go out as ``epd-error-*``
Kafka headers, so a broker tool can filter dead letters without decoding them, and the
original's own headers are kept in the letter (a replayed record's replay marks among them: a
record that fails again after a replay says so in its new dead letter).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from schemas.types import DeadLetter, ErrorInfo

ERROR_HEADER_PREFIX = "epd-error-"
"""Every header the envelope adds starts with this (a replay strips them again)."""
VALUE_DROPPED_HEADER = f"{ERROR_HEADER_PREFIX}value-dropped"
"""On a letter whose original value did not fit beside the envelope: the value's length."""
REPLAYED_FROM_HEADER = "epd-replayed-from"
"""On a republished record: the dead letter it came from, as ``dlq_topic:partition:offset``."""
REPLAY_COUNT_HEADER = "epd-replay-count"
"""On a republished record: how many times its payload has been replayed (1 for the first)."""
MESSAGE_HEADER_BYTES = 1024
"""The error message header is cut to this; the letter itself keeps the whole message."""


@dataclasses.dataclass(frozen=True, slots=True)
class Original:
    """Where the failed record came from, and what it was."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes]


def error_headers(
    original: Original, info: ErrorInfo, *, attempts: int, group: str
) -> dict[str, bytes]:
    """The ``epd-error-*`` headers of a dead letter (the error, the coordinates, the group)."""
    out = {
        f"{ERROR_HEADER_PREFIX}code": info.code.encode(),
        f"{ERROR_HEADER_PREFIX}message": info.message.encode()[:MESSAGE_HEADER_BYTES],
        f"{ERROR_HEADER_PREFIX}original-topic": original.topic.encode(),
        f"{ERROR_HEADER_PREFIX}original-partition": str(original.partition).encode(),
        f"{ERROR_HEADER_PREFIX}original-offset": str(original.offset).encode(),
        f"{ERROR_HEADER_PREFIX}attempts": str(attempts).encode(),
        f"{ERROR_HEADER_PREFIX}group": group.encode(),
    }
    for name in ("rule", "modality", "item", "field"):
        val = getattr(info, name)
        if val is not None:
            out[f"{ERROR_HEADER_PREFIX}{name}"] = str(val).encode()
    return out


def dead_letter(original: Original, info: ErrorInfo, *, attempts: int, group: str) -> DeadLetter:
    """The dead letter of ``original``: its record whole, the error, and the envelope headers
    on top of the original's own."""
    headers = error_headers(original, info, attempts=attempts, group=group)
    return DeadLetter(
        original_topic=original.topic,
        partition=original.partition,
        offset=original.offset,
        key=original.key,
        value=original.value,
        consumer_group=group,
        error=info,
        attempts=attempts,
        headers={**original.headers, **headers},
    )


def without_value(letter: DeadLetter) -> DeadLetter:
    """``letter`` with its original value dropped (it stays in the source topic at its
    offset), for a record too large to travel inside the envelope."""
    return dataclasses.replace(
        letter,
        value=b"",
        headers={**letter.headers, VALUE_DROPPED_HEADER: str(len(letter.value)).encode()},
    )


def envelope_headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    """The headers that go out on the dead letter's own record: the envelope's only."""
    return [(k, v) for k, v in letter.headers.items() if k.startswith(ERROR_HEADER_PREFIX)]


def original_headers(letter: DeadLetter) -> list[tuple[str, bytes]]:
    """The original record's own headers, without the envelope's and the replay marks."""
    return [
        (k, v)
        for k, v in letter.headers.items()
        if not k.startswith(ERROR_HEADER_PREFIX)
        and k not in (REPLAYED_FROM_HEADER, REPLAY_COUNT_HEADER)
    ]


def replay_count(letter: DeadLetter) -> int:
    """How many times the letter's payload was replayed before it failed (0: never)."""
    raw = letter.headers.get(REPLAY_COUNT_HEADER)
    if raw is None:
        return 0
    try:
        return int(raw)
    except ValueError:
        return 1  # a malformed count still says "replayed"


def replay_marks(letter: DeadLetter, position: str) -> list[tuple[str, bytes]]:
    """The headers a republished payload carries: the dead letter it came from
    (``dlq_topic:partition:offset``) and its replay count, so replay knows it if it comes back."""
    return [
        (REPLAYED_FROM_HEADER, position.encode()),
        (REPLAY_COUNT_HEADER, str(replay_count(letter) + 1).encode()),
    ]


def replayed_from(letter: DeadLetter) -> str | None:
    """The dead letter the payload was replayed from (``dlq:partition:offset``), if any."""
    raw = letter.headers.get(REPLAYED_FROM_HEADER)
    return raw.decode("utf-8", "replace") if raw is not None else None
