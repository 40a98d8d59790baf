"""Reading and replaying the dead-letter topic (the logic behind ``epd dlq``).

A dead letter (written by :class:`~consumers.loop.ConsumeLoop`) carries the original record:
topic, partition, offset, key, value bytes and headers, plus the error (code, rule, modality,
item) and the attempts made. This module lists them, finds one by position, and replays them.

Replay is guarded three ways, so it can never feed a record back into the failure it came from:

* **Re-validation first.** The original value is decoded and checked against the event type its
  topic carries and the validator rules the workers apply (and its deadline). An undecodable or
  still-invalid record is not republished; the outcome names the rule (and modality/item).
* **No loops.** A republished record carries ``epd-replayed-from`` (``dlq:p:o`` of the dead
  letter) and ``epd-replay-count`` (:mod:`schemas.dead_letters`, the envelope's one home). The
  consume loop copies a record's headers into its dead
  letter, so when a replayed record fails again its new dead letter still says it was replayed,
  and replay refuses it (fix the cause and resubmit instead).
* **Once per dead letter.** A :class:`ReplayLedger` in Redis remembers which dead letters were
  republished, so running ``epd dlq replay`` twice does not republish the same record twice. The
  mark is written after the broker acknowledged the record: a crash in between can replay a record
  a second time (the stages are idempotent), never lose it.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from aiokafka import TopicPartition

from runtime.kafka import make_consumer, read_topic, topic_partitions
from runtime.redis_cluster import read_many
from runtime.settings import Settings
from schemas import codec
from schemas import dead_letters as envelope
from schemas.errors import CodecError, ValidationError
from schemas.keys import RedisKeys
from schemas.topics import Topics
from schemas.types import (
    DeadLetter,
    DecodeEvent,
    EncodeEvent,
    ErrorInfo,
    PrefillEvent,
    RenderEvent,
    TensorRef,
    now_ms,
)
from schemas.validator import (
    ValidationConfig,
    validate_decode_event,
    validate_encode_event,
    validate_prefill_event,
    validate_render_event,
)
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

    from runtime.redis_cluster import RedisClient
    from runtime.stores.base import EmbeddingStore


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])", re.IGNORECASE)
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
        "failed": _iso(r.failed_ms),
        "failed_ms": r.failed_ms,
        "replayed_from": r.replayed_from,
        "replay_count": r.replay_count,
        "replayed": _iso(r.replayed_ms) if r.replayed_ms is not None else None,
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


def _iso(ms: int) -> str:
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
        out["deadline"] = _iso(ev.deadline_ms)
    return out


# --- replay ---------------------------------------------------------------------------------


def check_replayable(
    r: DeadLetterRecord, topics: Topics, config: ValidationConfig, now: int | None = None
) -> ErrorInfo | None:
    """Why ``r`` must not be republished, or None when it may be.

    The checks a worker would apply before doing any work: the payload decodes as the event its
    topic carries, its deadline has not passed, and it passes the validator's rules. A record that
    was itself a replay is refused outright (it failed again: replaying it would loop).
    """
    expected = _replay_target(r, topics)
    if isinstance(expected, ErrorInfo):
        return expected
    assert r.letter is not None
    try:
        ev: Any = codec.decode(r.letter.value, expected)
    except CodecError as exc:
        return ErrorInfo("undecodable", f"the original does not decode: {exc}")
    return _expired(ev, now) or _invalid(ev, config)


def _replay_target(r: DeadLetterRecord, topics: Topics) -> type | ErrorInfo:
    """The event type the letter's payload must decode as, or why there is none to replay."""
    if r.letter is None:
        return ErrorInfo("dlq-undecodable", f"the DLQ record does not decode: {r.decode_error}")
    lt = r.letter
    if r.replayed_from is not None:
        return ErrorInfo(
            "replay-failed-again",
            f"this record was already replayed (from {r.replayed_from}, replay "
            f"#{r.replay_count}) and failed again; replaying it would loop. Fix the cause and "
            "submit the request again.",
        )
    expected = topics.event_type(lt.original_topic)
    if expected is None or expected is DeadLetter:  # the DLQ itself is no replay target
        return ErrorInfo(
            "unknown-topic",
            f"original topic {lt.original_topic!r} is not a replayable topic of pipeline "
            f"{topics.prefix!r}",
        )
    if not lt.value:
        dropped = lt.headers.get(envelope.VALUE_DROPPED_HEADER, b"?").decode("utf-8", "replace")
        return ErrorInfo(
            "payload-dropped",
            f"the {dropped}-byte original was too large for the DLQ and is not in it; it is "
            f"still at {r.source} while the topic retains it",
        )
    return expected


def _expired(ev: Any, now: int | None) -> ErrorInfo | None:
    deadline = getattr(ev, "deadline_ms", None)
    if deadline_passed(deadline, now_ms() if now is None else now):
        return ErrorInfo(
            "expired", f"its deadline passed at {_iso(deadline)}; the worker would only expire it"
        )
    return None


_VALIDATORS: dict[type, Callable[[Any, ValidationConfig], None]] = {
    RenderEvent: validate_render_event,
    EncodeEvent: validate_encode_event,
    PrefillEvent: validate_prefill_event,
    DecodeEvent: validate_decode_event,
}
"""The rules the worker of each replayable event type applies before any work."""


def _invalid(ev: Any, config: ValidationConfig) -> ErrorInfo | None:
    check = _VALIDATORS.get(type(ev))
    try:
        if check is not None:
            check(ev, config)
    except ValidationError as exc:
        return ErrorInfo(
            "still-invalid",
            exc.detail,
            rule=exc.rule,
            modality=exc.modality,
            item=exc.item,
            field=exc.field,
        )
    return None


async def check_claims(r: DeadLetterRecord, store: EmbeddingStore) -> ErrorInfo | None:
    """For an encode event whose inputs were claim-checked into ``store``: why replaying it would
    fail at the worker, or None.

    Claim checks live ``EPD_CLAIM_TTL_S`` and are deleted once the embedding is stored, so an
    old encode dead letter can point at inputs that are gone. That is fine when the embedding is
    in the store (the worker has a hit and reads no claim); otherwise the event cannot succeed.
    """
    if r.letter is None or not r.letter.value:
        return None
    try:
        ev: Any = codec.decode(r.letter.value)
    except CodecError:
        return None  # check_replayable reports it
    if not isinstance(ev, EncodeEvent):
        return None
    refs = [
        (name, v)
        for name, v in ev.data.items()
        if isinstance(v, TensorRef) and v.store == store.url
    ]
    if not refs:
        return None
    if ev.ec_transfer.store == store.url and await store.exists(ev.ec_transfer.key):
        return None
    for name, ref in refs:
        if not await store.exists(ref.key):
            return ErrorInfo(
                "claim-check-gone",
                f"the claim-checked input {ref.key!r} is no longer in the store and the item's "
                "embedding is not there either; submit the request again",
                rule="claim-check",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
    return None


def replay_headers(r: DeadLetterRecord) -> list[tuple[str, bytes]]:
    """The original record's headers (minus the DLQ's ``epd-error-*`` ones), plus the replay
    marks that let replay recognise this payload if it is dead-lettered again."""
    assert r.letter is not None
    position = f"{r.topic}:{r.partition}:{r.offset}"
    return [*envelope.original_headers(r.letter), *envelope.replay_marks(r.letter, position)]


class ReplayLedger:
    """Which dead letters were republished, in Redis (value: epoch ms of the replay), kept
    ``ttl_s`` (outlive the DLQ's retention).

    Key: ``{prefix}:dlq-replayed:{topic}:{p}:{o}:{failed_ms}``. The failure time is part of it
    because a position alone is not an identity: a recreated topic (or a restarted in-memory
    broker) starts its offsets again, and its new dead letters must not look replayed.
    """

    def __init__(self, client: RedisClient, *, prefix: str, ttl_s: int) -> None:
        self.client = client
        self.prefix = prefix
        self.keys = RedisKeys(prefix)
        self.ttl_s = ttl_s

    def key(self, r: DeadLetterRecord) -> str:
        return self.keys.dlq_replayed(r.topic, r.partition, r.offset, r.failed_ms)

    async def annotate(self, records: Sequence[DeadLetterRecord]) -> None:
        """Fill in ``replayed_ms`` of each record from the ledger."""
        if not records:
            return
        values = await read_many(self.client, [self.key(r) for r in records])
        for r, v in zip(records, values, strict=True):
            r.replayed_ms = int(v) if v is not None else None

    async def mark(self, r: DeadLetterRecord, when_ms: int) -> None:
        await self.client.set(self.key(r), str(when_ms), ex=self.ttl_s)
        r.replayed_ms = when_ms


@dataclass(slots=True)
class ReplayOutcome:
    """What replay did with one dead letter."""

    record: DeadLetterRecord
    action: str
    """``replayed``, ``would-replay`` (dry run) or ``skipped``."""
    reason: ErrorInfo | None = None
    target: str | None = None
    """``topic[partition]@offset`` the payload was republished to."""

    def describe(self) -> dict[str, Any]:
        return {
            "position": self.record.position,
            "source": self.record.source,
            "action": self.action,
            "reason": asdict(self.reason) if self.reason is not None else None,
            "target": self.target,
        }


@dataclass
class Replayer:
    """Republishes dead letters that pass :func:`check_replayable` to their original topics."""

    topics: Topics
    config: ValidationConfig
    ledger: ReplayLedger
    producer: AIOKafkaProducer | None = None
    """Started producer; None only for dry runs."""
    store: EmbeddingStore | None = None
    """The embedding store, to check that an encode event's claim checks still exist."""

    async def replay(
        self, records: Sequence[DeadLetterRecord], *, dry_run: bool = False
    ) -> list[ReplayOutcome]:
        """One outcome per record, in order. Stops (raising) on a broker error; records replayed
        before it are marked, the rest are untouched and can be replayed again."""
        await self.ledger.annotate(records)
        return [await self._one(r, dry_run) for r in records]

    async def _one(self, r: DeadLetterRecord, dry_run: bool) -> ReplayOutcome:
        if r.replayed_ms is not None:
            return ReplayOutcome(
                r,
                "skipped",
                ErrorInfo("already-replayed", f"replayed before, at {_iso(r.replayed_ms)}"),
            )
        reason = check_replayable(r, self.topics, self.config)
        if reason is None and self.store is not None:
            reason = await check_claims(r, self.store)
        if reason is not None:
            return ReplayOutcome(r, "skipped", reason)
        if dry_run:
            return ReplayOutcome(r, "would-replay")
        assert r.letter is not None and self.producer is not None
        lt = r.letter
        meta = await self.producer.send_and_wait(
            lt.original_topic, value=lt.value, key=lt.key, headers=replay_headers(r)
        )
        await self.ledger.mark(r, now_ms())
        return ReplayOutcome(r, "replayed", target=f"{meta.topic}[{meta.partition}]@{meta.offset}")


def outcome_line(o: ReplayOutcome) -> str:
    """One human-readable line per outcome (the CLI's default output)."""
    head = f"{o.action:<12} {o.record.position:<8} {o.record.source}"
    if o.target is not None:
        return f"{head} -> {o.target}"
    if o.reason is None:
        return head
    return f"{head}: {format_error(o.reason)}"


def format_error(e: ErrorInfo) -> str:
    """``code rule=... modality=... item=... field=...: message``."""
    where = [
        f"{name}={v}"
        for name in ("rule", "modality", "item", "field")
        if (v := getattr(e, name)) is not None
    ]
    return " ".join([e.code, *where]) + f": {e.message}"
