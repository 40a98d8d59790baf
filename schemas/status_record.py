"""A request's status record: its type, its fold and the names inside it (pure: no I/O).

The record is folded from ResultEvents (:func:`fold`): the status only moves forward, the first
terminal status wins, stage timings and info are merged, and a redelivered update changes
nothing. It lives in Redis as JSON (:mod:`runtime.status.store`); :meth:`StatusRecord.to_json`
writes exactly the object the store has always written, and :meth:`StatusRecord.from_json` reads
what any earlier version wrote (a frozen set of them is tested), keeping the key order it found
and every key it does not know, so a record read and written back is the same text.

The conventions of the record's maps are spelled here only: ``stages`` maps
``"<stage>:<status>"`` (:func:`stage_key`) to the first time of that update; an item's encode
mark is the stage ``encode.<hash12>`` (:func:`encode_stage`, :func:`short_hash`) with
``info["encoded.<hash12>"]`` (or ``encode_failed.<hash12>``) and ``timings["encode.<hash12>"]``
/ ``timings["encode_hop.<hash12>"]``; the fan-out's ``info`` carries ``encode_events`` and
``deadline_ms`` (:func:`fanout_info`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from schemas.statuses import ACTIVE_STATUSES, TERMINAL_STATUSES
from schemas.types import EncodedEvent, ResultEvent, now_ms

_RANK: dict[str, int] = {status: rank for rank, status in enumerate(ACTIVE_STATUSES)}
_TERMINAL_RANK = len(ACTIVE_STATUSES)

SHORT_HASH_CHARS = 12
ENCODE_MARK = "encode."
"""Prefix of the per-item encode stages and of their timings (``encode.<hash12>``)."""
HANDOFF_INFO = "prefill.handoff"
"""Info key a prefill worker sets (to ``decode``) when it hands the request to the decode stage."""
ROUTED_INFO = "fanout.routed"
"""Info key the render router's fan-out sets (to ``1``) on its update: the first word of a
request that came in without the intake, which makes the request's record (:func:`makes_record`)."""
_ENCODED = "encoded."
_ENCODE_FAILED = "encode_failed."
_ENCODE_HOP = "encode_hop."
_ENCODE_EVENTS = "encode_events"
_DEADLINE = "deadline_ms"
_ENCODED_VALUES = ("encoded", "cache_hit")

_HEAD = ("request_id", "status", "stages", "timings", "info", "token_ids", "text", "error")
_OWN = (*_HEAD, "created_ms", "stages_last", "finished_ms", "updated_ms")
"""The keys the fold owns, in the order a new record writes them (the front's fields go
between ``created_ms`` and ``stages_last``)."""


def short_hash(mm_hash: str) -> str:
    """The item hash as the record's keys carry it (its first 12 characters)."""
    return mm_hash[:SHORT_HASH_CHARS]


def stage_key(stage: str, status: str) -> str:
    """The ``stages`` key of one (stage, status) update, e.g. ``prefill:completed``."""
    return f"{stage}:{status}"


def encode_stage(mm_hash: str) -> str:
    """The stage name of one item's encode mark (``encode.<hash12>``)."""
    return ENCODE_MARK + short_hash(mm_hash)


def fanout_info(
    *, encode_events: int, deadline_ms: int | None, routed: bool = False
) -> dict[str, str]:
    """The ``info`` the fan-out records: how many encode events it sent, and the deadline;
    ``routed``: the router's fan-out, whose update makes the record (:data:`ROUTED_INFO`)."""
    info = {_ENCODE_EVENTS: str(encode_events), _DEADLINE: str(deadline_ms)}
    if routed:
        info[ROUTED_INFO] = "1"
    return info


def makes_record(ev: ResultEvent) -> bool:
    """Whether ``ev`` may make its request's record where there is none: only the render
    router's fan-out update does (an external renderer's request has no intake to make it),
    wherever it is folded (written through, or by the results collector). Every other update
    folds into the record it finds, so a record that went is never made again without its
    tenant and front."""
    return ev.stage == "fanout" and ev.info.get(ROUTED_INFO) == "1"


def _rank(status: str) -> int:
    return _TERMINAL_RANK if status in TERMINAL_STATUSES else _RANK.get(status, 0)


def _int_or_none(raw: Any) -> int | None:
    try:
        return int(raw) if raw not in (None, "", "None") else None
    except (TypeError, ValueError):
        return None


@dataclass(slots=True)
class StatusRecord:
    """One request's status as the stages reported it (see the module docstring)."""

    request_id: str
    status: str = "queued"
    stages: dict[str, int] = field(default_factory=dict)
    """``"<stage>:<status>"`` -> time of the first such update (epoch ms)."""
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)
    token_ids: list[int] | None = None
    text: str | None = None
    error: dict[str, Any] | None = None
    """The outcome's ``ErrorInfo`` fields (code, message, rule, modality, item, field)."""
    created_ms: int = field(default_factory=now_ms)
    stages_last: dict[str, int] = field(default_factory=dict)
    """Pairs seen more than once (a second item's ``encode:encoding``) -> the last time."""
    finished_ms: int | None = None
    updated_ms: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    """What the front door wrote (``tenant``, ``metadata``, ``items``, ``render``, ``cached``)
    and any key this version does not know, as they came."""
    key_order: tuple[str, ...] = field(default=(), compare=False, repr=False)
    """The top-level key order of the JSON this record was read from (kept on write)."""

    # ------------------------------------------------------------------------- JSON

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StatusRecord:
        """A record from its JSON object (as any version of the store wrote it)."""
        return cls(
            request_id=str(raw["request_id"]),
            status=str(raw.get("status") or "queued"),
            stages=dict(raw.get("stages") or {}),
            timings=dict(raw.get("timings") or {}),
            info=dict(raw.get("info") or {}),
            token_ids=raw.get("token_ids"),
            text=raw.get("text"),
            error=raw.get("error"),
            created_ms=int(raw.get("created_ms") or 0),
            stages_last=dict(raw.get("stages_last") or {}),
            finished_ms=_int_or_none(raw.get("finished_ms")),
            updated_ms=_int_or_none(raw.get("updated_ms")),
            fields={k: v for k, v in raw.items() if k not in _OWN},
            key_order=tuple(raw),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> StatusRecord:
        return cls.from_dict(json.loads(text))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the keys in the order they were read, new ones after them."""
        values: dict[str, Any] = {k: getattr(self, k) for k in _HEAD}
        values["created_ms"] = self.created_ms
        values.update(self.fields)
        if self.stages_last:
            values["stages_last"] = self.stages_last
        if self.finished_ms is not None:
            values["finished_ms"] = self.finished_ms
        if self.updated_ms is not None:
            values["updated_ms"] = self.updated_ms
        if not self.key_order:
            return values
        ordered = {k: values[k] for k in self.key_order if k in values}
        ordered.update(values)
        return ordered

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    # --------------------------------------------------------------- what the front wrote

    @property
    def tenant(self) -> str | None:
        return self.fields.get("tenant")

    @property
    def metadata(self) -> Any:
        return self.fields.get("metadata")

    @property
    def items(self) -> list[dict[str, Any]]:
        """The request's items (``modality``, ``mm_hash``) as the front recorded them."""
        return list(self.fields.get("items") or [])

    @property
    def cached(self) -> list[str] | None:
        """Hashes of the items the fan-out found cached; None when it has not said yet."""
        cached = self.fields.get("cached")
        return None if cached is None else list(cached)

    @property
    def render(self) -> dict[str, Any]:
        """The front's render timing (``started_ms``, ``finished_ms``, ``ms``), if it rendered."""
        return dict(self.fields.get("render") or {})

    @property
    def front(self) -> dict[str, Any]:
        """What an OpenAI-compatible route recorded of its call (``api``, ``model``,
        ``max_tokens``, ``created_s``...); empty for a native request."""
        return dict(self.fields.get("front") or {})

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens as the intake recorded it (0: not recorded)."""
        return int(self.fields.get("prompt_tokens") or 0)

    def with_fields(self, fields: dict[str, Any]) -> StatusRecord:
        """A copy with top-level ``fields`` merged in (a key the fold owns is set as such)."""
        merged = self.to_dict()
        merged.update(copy.deepcopy(fields))
        return StatusRecord.from_dict(merged)

    # ----------------------------------------------------------------------- reading it

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def stage_time(self, stage: str, status: str) -> int | None:
        """When ``stage`` first reported ``status`` (epoch ms), or None."""
        return self.stages.get(stage_key(stage, status))

    def reached(self, stage: str) -> bool:
        """Whether ``stage`` reported anything (any status)."""
        return any(k.startswith(stage + ":") for k in self.stages)

    @property
    def oldest_ms(self) -> int:
        """The earliest stage update the record holds (its creation time if none)."""
        return min((int(t) for t in self.stages.values()), default=int(self.created_ms or 0))

    def encoded_items(self) -> frozenset[str]:
        """The short hashes the encode stage marked stored (``encoded``) or ``cache_hit``."""
        return frozenset(
            k.removeprefix(_ENCODED)
            for k, v in self.info.items()
            if k.startswith(_ENCODED) and v in _ENCODED_VALUES
        )

    def item_encoded(self, mm_hash: str) -> bool:
        """Whether the item ``mm_hash`` is marked stored or cached."""
        return self.info.get(_ENCODED + short_hash(mm_hash)) in _ENCODED_VALUES

    def encode_ms(self, mm_hash: str) -> float | None:
        """The encoder's time for one item, as its mark recorded it."""
        return self.timings.get(ENCODE_MARK + short_hash(mm_hash))

    def encode_hop_ms(self, mm_hash: str) -> float | None:
        """The broker hop one item's encode event took, as the encoder recorded it."""
        return self.timings.get(_ENCODE_HOP + short_hash(mm_hash))

    def encode_total_ms(self) -> float | None:
        """Encoder time summed over every encode timing recorded (None: none yet)."""
        times = [v for k, v in self.timings.items() if k.startswith(ENCODE_MARK)]
        return sum(times) if times else None

    def encode_finished_ms(self) -> int | None:
        """When the last item's encode mark landed: each item's stage writes its own mark
        (``encode.<hash12>:encoding``); a stage that reported as a whole wrote
        ``encode:encoding``."""
        marks = [
            t
            for seen in (self.stages, self.stages_last)
            for key, t in seen.items()
            if key.endswith(":encoding")
            and (key.startswith(ENCODE_MARK) or key == "encode:encoding")
        ]
        return max(marks) if marks else None

    @property
    def deadline_ms(self) -> int | None:
        """The request's deadline as the fan-out recorded it (None: none, or not yet)."""
        return _int_or_none(self.info.get(_DEADLINE))

    @property
    def encode_events(self) -> int | None:
        """How many encode events the fan-out sent (None: not fanned out yet, or unreadable)."""
        return _int_or_none(self.info.get(_ENCODE_EVENTS))

    def items_pending(self) -> bool:
        """Whether fewer items are marked (encoded, cached or failed) than the fan-out sent
        encode events for."""
        marked = sum(1 for k in self.info if k.startswith((_ENCODED, _ENCODE_FAILED)))
        return marked < (self.encode_events or 0)

    def change_entry(self, stage: str) -> str:
        """The JSON of this record's latest status change as the event stream keeps it."""
        entry: dict[str, Any] = {
            "request_id": self.request_id,
            "status": self.status,
            "stage": stage,
            "at_ms": self.updated_ms,
        }
        if self.terminal:
            entry["token_ids"] = self.token_ids
            entry["text"] = self.text
            entry["error"] = self.error
        return json.dumps(entry)


# ----------------------------------------------------------------------------- the fold


def created(request_id: str, fields: dict[str, Any], *, at_ms: int | None = None) -> StatusRecord:
    """A new ``queued`` record made by the front (``api:queued``), carrying ``fields``."""
    at = at_ms if at_ms is not None else now_ms()
    rec = StatusRecord(request_id, created_ms=at).with_fields(fields)
    rec.stages[stage_key("api", "queued")] = rec.created_ms
    rec.updated_ms = rec.created_ms
    return rec


def fold_steps(
    record: StatusRecord | None, events: Sequence[ResultEvent]
) -> list[tuple[StatusRecord, str]]:
    """``events`` folded into ``record`` in order: the record after each one that changed
    something, with that event's stage (empty when none did)."""
    steps: list[tuple[StatusRecord, str]] = []
    for ev in events:
        nxt = fold(record, ev)
        if nxt is not None:
            steps.append((nxt, ev.stage))
            record = nxt
    return steps


def fold(record: StatusRecord | None, ev: ResultEvent) -> StatusRecord | None:
    """The record after applying one ResultEvent, or None when it changes nothing.

    Rules: the status only moves forward (queued < encoding < prefilling < decoding <
    terminal) and the first terminal status wins, so a redelivered or late event cannot undo
    an outcome (a ``completed`` after a ``cancelled`` changes nothing). Stage timings and info
    are merged; a (stage, status) pair already seen, with nothing new in its timings and
    info, is a duplicate (``stages`` keeps the first time of a pair, ``stages_last`` the last).
    ``record`` itself is never changed.
    """
    if record is None:
        rec = StatusRecord(ev.request_id, created_ms=ev.created_ms)
    else:  # the maps the fold changes are copied; the rest it only replaces
        rec = replace(
            record,
            stages=dict(record.stages),
            timings=dict(record.timings),
            info=dict(record.info),
            stages_last=dict(record.stages_last),
        )
    seen_key = stage_key(ev.stage, ev.status)
    if seen_key in rec.stages:
        # A redelivery brings nothing new. Another item's update of the same stage (a second
        # image's "encode:encoding") does: its timings and info are kept.
        if all(rec.timings.get(k) == v for k, v in ev.timings.items()) and all(
            rec.info.get(k) == v for k, v in ev.info.items()
        ):
            return None
        rec.stages_last[seen_key] = ev.created_ms
    else:
        rec.stages[seen_key] = ev.created_ms
    was_terminal = rec.terminal
    rec.timings.update(ev.timings)
    rec.info.update(ev.info)
    if not was_terminal and _rank(ev.status) >= _rank(rec.status):
        rec.status = ev.status
        if rec.terminal:
            rec.finished_ms = ev.created_ms
            rec.token_ids = ev.token_ids
            rec.text = ev.text
            rec.error = asdict(ev.error) if ev.error else None
    elif was_terminal and ev.status == rec.status and rec.token_ids is None and ev.token_ids:
        # The same outcome from the stage that did the work fills in what the first lacked: a
        # cancel from the API carries no tokens, the worker's carries those made before it.
        rec.token_ids = ev.token_ids
        rec.text = ev.text
    rec.updated_ms = now_ms()
    return rec


def encoded_update(ev: EncodedEvent, *, hop_ms: float | None = None) -> ResultEvent:
    """The status update an EncodedEvent stands for.

    The stage name carries the item's hash, so each item is recorded once (a redelivered
    EncodedEvent is a duplicate) while different items of one request all land. ``hop_ms``: the
    broker hop the encode event came through, which the encode worker adds to its own write of
    the mark (the EncodedEvent does not carry it).
    """
    short = short_hash(ev.mm_hash)
    info = {_ENCODED + short: "cache_hit" if ev.cache_hit else "encoded"}
    timings = {} if ev.cache_hit else {ENCODE_MARK + short: ev.encode_ms}
    if hop_ms is not None:
        timings[_ENCODE_HOP + short] = hop_ms
    if not ev.ok:
        info = {_ENCODE_FAILED + short: ev.error.code if ev.error else "error"}
        timings = {}
    return ResultEvent(
        request_id=ev.request_id,
        stage=encode_stage(ev.mm_hash),
        status="encoding",
        timings=timings,
        info=info,
        worker="",
        created_ms=ev.created_ms,
    )


__all__ = [
    "ENCODE_MARK",
    "HANDOFF_INFO",
    "ROUTED_INFO",
    "StatusRecord",
    "created",
    "encode_stage",
    "encoded_update",
    "fanout_info",
    "fold",
    "makes_record",
    "short_hash",
    "stage_key",
]
