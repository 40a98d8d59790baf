"""Reading the dead-letter topic: list the letters, find one by position, describe them.

The other half of :mod:`consumers.dead_letters`: :mod:`~consumers.dead_letters.writer` puts a
letter on the topic (the consume loop's last word on a record), this module reads them back for
``epd dlq list/show`` and :mod:`~consumers.dead_letters.replay` republishes them. A dead letter
carries the original record: topic, partition, offset, key, value bytes and headers, plus the
error (code, rule, modality, item) and the attempts made.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from aiokafka import TopicPartition

from runtime.kafka import make_consumer, read_topic, topic_partitions
from runtime.settings import Settings
from schemas import codec
from schemas import dead_letters as envelope
from schemas.errors import CodecError
from schemas.types import DeadLetter, now_ms

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])", re.IGNORECASE)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


# --- positions and times ------------------------------------------------------------------------


def parse_since(text: str, now: int | None = None) -> int:
    """``--since`` as epoch milliseconds: a duration back from now (``90s``, ``15m``, ``2h``,
    ``1h30m``, ``7d``) or an ISO 8601 time (``2026-11-30T21:00:00Z``; naive times are UTC).

    Raises ValueError with a message naming the accepted forms.
    """
    s = text.strip()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2).lower()]
        pos = m.end()
    if s and pos == len(s):
        return (now if now is not None else now_ms()) - int(total * 1000)
    try:
        when = datetime.fromisoformat(s.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"--since {text!r}: expected a duration (30s, 15m, 2h, 1h30m, 7d) or an ISO 8601 "
            "time (2026-11-30T21:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


def parse_position(text: str) -> tuple[int | None, int]:
    """``OFFSET`` or ``PARTITION:OFFSET`` -> (partition or None, offset); ValueError otherwise."""
    parts = text.strip().split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (1, 2) or any(n < 0 for n in nums):
        raise ValueError(f"{text!r}: expected OFFSET or PARTITION:OFFSET (non-negative integers)")
    return (None, nums[0]) if len(nums) == 1 else (nums[0], nums[1])


# --- records --------------------------------------------------------------------------------


@dataclass(slots=True)
class DeadLetterRecord:
    """One record of the DLQ topic: where it sits there, and the dead letter it holds."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    letter: DeadLetter | None
    """None when the DLQ record itself cannot be decoded (see ``decode_error``)."""
    decode_error: str | None = None
    replayed_ms: int | None = None
    """When :class:`ReplayLedger` says this dead letter was republished (filled in by callers)."""

    @property
    def position(self) -> str:
        """``partition:offset`` in the DLQ topic (what ``epd dlq show`` takes)."""
        return f"{self.partition}:{self.offset}"

    @property
    def source(self) -> str:
        """Where the original record was: ``topic[partition]@offset``."""
        if self.letter is None:
            return "?"
        lt = self.letter
        return f"{lt.original_topic}[{lt.partition}]@{lt.offset}"

    @property
    def failed_ms(self) -> int:
        return self.letter.failed_ms if self.letter is not None else self.timestamp_ms

    @property
    def replayed_from(self) -> str | None:
        """The dead letter this record's payload was replayed from, if it was a replay."""
        return envelope.replayed_from(self.letter) if self.letter is not None else None

    @property
    def replay_count(self) -> int:
        """How many times the payload had been replayed when it failed (0: never)."""
        return envelope.replay_count(self.letter) if self.letter is not None else 0


def _record(rec: Any) -> DeadLetterRecord:
    try:
        letter: DeadLetter | None = codec.decode(rec.value or b"", DeadLetter)
        err = None
    except CodecError as exc:
        letter, err = None, str(exc)
    return DeadLetterRecord(rec.topic, rec.partition, rec.offset, rec.timestamp, letter, err)


@dataclass(frozen=True, slots=True)
class LetterFilter:
    """Which dead letters a command looks at; every set field must match."""

    since_ms: int | None = None
    rule: str | None = None
    code: str | None = None

    def __call__(self, r: DeadLetterRecord) -> bool:
        if self.since_ms is not None and r.failed_ms < self.since_ms:
            return False
        err = r.letter.error if r.letter is not None else None
        if self.rule is not None and (err is None or err.rule != self.rule):
            return False
        return not (self.code is not None and (err is None or err.code != self.code))


async def read_dead_letters(
    settings: Settings,
    topic: str,
    keep: Callable[[DeadLetterRecord], bool] = LetterFilter(),
    *,
    timeout_s: float = 30.0,
) -> list[DeadLetterRecord]:
    """Every dead letter in ``topic`` (up to its current end) that ``keep`` accepts, in the order
    they failed. Undecodable DLQ records are kept (filters on rule/code skip them)."""
    out = [_record(rec) for rec in await read_topic(settings, topic, timeout_s=timeout_s)]
    out.sort(key=lambda r: (r.failed_ms, r.partition, r.offset))
    return [r for r in out if keep(r)]


class NotFound(LookupError):
    """No dead letter at the position asked for (the message says what the topic holds)."""


async def fetch_dead_letter(
    settings: Settings, topic: str, partition: int | None, offset: int, *, timeout_s: float = 30.0
) -> DeadLetterRecord:
    """The dead letter at ``partition:offset`` of ``topic``. Without a partition, the offset must
    exist in exactly one partition. Raises :class:`NotFound` otherwise."""
    consumer = make_consumer(settings, group_id=None)
    try:
        await consumer.start()
        parts = set((await topic_partitions(settings, [topic])).get(topic, []))
        if not parts:
            raise NotFound(f"topic {topic!r} does not exist")
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        first = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        if partition is not None:
            if partition not in parts:
                raise NotFound(f"{topic} has partitions {sorted(parts)}, not {partition}")
            candidates = [TopicPartition(topic, partition)]
        else:
            candidates = [tp for tp in tps if first[tp] <= offset < end[tp]]
            if len(candidates) > 1:
                where = ", ".join(f"{tp.partition}:{offset}" for tp in candidates)
                raise NotFound(f"offset {offset} exists in several partitions: give one of {where}")
        if not candidates or not first[candidates[0]] <= offset < end[candidates[0]]:
            held = ", ".join(f"{tp.partition}:[{first[tp]},{end[tp]})" for tp in tps)
            raise NotFound(f"no dead letter at offset {offset}; {topic} holds {held}")
        tp = candidates[0]
        consumer.assign([tp])
        consumer.seek(tp, offset)
        async with asyncio.timeout(timeout_s):
            while True:
                batch = await consumer.getmany(tp, timeout_ms=500)
                for rec in batch.get(tp, []):
                    if rec.offset >= offset:
                        return _record(rec)
    finally:
        await consumer.stop()


def describe(r: DeadLetterRecord, *, with_value: bool = False) -> dict[str, Any]:
    """A dead letter as JSON-ready values (what ``--json`` prints)."""
    out: dict[str, Any] = {
        "position": r.position,
        "dlq_topic": r.topic,
        "partition": r.partition,
        "offset": r.offset,
        "failed": iso_time(r.failed_ms),
        "failed_ms": r.failed_ms,
        "replayed_from": r.replayed_from,
        "replay_count": r.replay_count,
        "replayed": iso_time(r.replayed_ms) if r.replayed_ms is not None else None,
    }
    if r.letter is None:
        out["decode_error"] = r.decode_error
        return out
    lt = r.letter
    out.update(
        original_topic=lt.original_topic,
        original_partition=lt.partition,
        original_offset=lt.offset,
        key=lt.key.decode("utf-8", "replace") if lt.key is not None else None,
        consumer_group=lt.consumer_group,
        attempts=lt.attempts,
        error=asdict(lt.error),
        value_bytes=len(lt.value),
    )
    if with_value:
        out["headers"] = {k: _header_text(v) for k, v in sorted(lt.headers.items())}
        out["event"] = _event_summary(lt.value)
    return out


def iso_time(ms: int) -> str:
    """Epoch milliseconds as an ISO 8601 UTC time, to the millisecond."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")


def _header_text(v: bytes) -> str:
    try:
        text = v.decode("utf-8")
    except UnicodeDecodeError:
        return f"<{len(v)} bytes: {v[:32].hex()}{'...' if len(v) > 32 else ''}>"
    return text if text.isprintable() else repr(text)


_SUMMARY_FIELDS = ("request_id", "model", "modality", "item_index", "mm_hash", "stage", "status")


def _event_summary(value: bytes) -> dict[str, Any]:
    """The original event's type and identifying fields (never its tensors)."""
    if not value:
        return {"type": None, "note": "payload dropped (too large for the DLQ)"}
    try:
        ev: Any = codec.decode(value)
    except CodecError as exc:
        return {"type": None, "decode_error": str(exc)}
    out: dict[str, Any] = {"type": type(ev).__name__}
    for name in _SUMMARY_FIELDS:
        v = getattr(ev, name, None)
        if v is not None:
            out[name] = v
    if getattr(ev, "deadline_ms", None) is not None:
        out["deadline"] = iso_time(ev.deadline_ms)
    return out
