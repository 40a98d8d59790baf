"""Replaying dead letters to their original topics (the logic behind ``epd dlq replay``).

Replay is guarded three ways, so it can never feed a record back into the failure it came from:

* **Re-validation first.** The original value is decoded and checked against the event type its
  topic carries and the validator rules the workers apply (and its deadline). An undecodable or
  still-invalid record is not republished; the outcome names the rule (and modality/item).
* **No loops.** A republished record carries ``epd-replayed-from`` (``dlq:p:o`` of the dead
  letter) and ``epd-replay-count`` (:mod:`schemas.dead_letters`, the envelope's one home). The
  dead-letter writer copies a record's headers into its dead letter, so when a replayed record
  fails again its new dead letter still says it was replayed, and replay refuses it (fix the
  cause and resubmit instead).
* **Once per dead letter.** A :class:`ReplayLedger` in Redis remembers which dead letters were
  republished, so running ``epd dlq replay`` twice does not republish the same record twice. The
  mark is written after the broker acknowledged the record: a crash in between can replay a record
  a second time (the stages are idempotent), never lose it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from consumers.dead_letters.reader import DeadLetterRecord, iso_time
from runtime.redis.cluster import read_many
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

    from runtime.redis.cluster import RedisClient
    from runtime.stores.base import EmbeddingStore


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
            "expired",
            f"its deadline passed at {iso_time(deadline)}; the worker would only expire it",
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
                ErrorInfo("already-replayed", f"replayed before, at {iso_time(r.replayed_ms)}"),
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
