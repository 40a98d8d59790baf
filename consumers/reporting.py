"""Turning dead letters into request outcomes, so a rejected event shows up in its status."""

from __future__ import annotations

from typing import TYPE_CHECKING

from runtime.reporting import ResultReporter, StatusWriter
from schemas.topics import Topics
from schemas.types import ErrorInfo

if TYPE_CHECKING:
    from consumers.records import ConsumedEvent, DeadLetterHook
    from runtime.publisher import Publisher

# Codes that mean "this input is bad" (rejected) rather than "we failed to process it".
REJECTION_CODES = frozenset({"validation", "undecodable", "oversize", "rejected", "compute"})


def _status_of(code: str) -> str:
    """The terminal status a dead letter's code stands for."""
    if code in REJECTION_CODES:
        return "rejected"
    # The deadline passed while the store or broker was down: it expired, nothing failed.
    return "expired" if code == "expired" else "failed"


def request_id_of(ce: ConsumedEvent, topics: Topics) -> str | None:
    """The request a consumed record belongs to: from the decoded event, or (an undecodable
    record) from its key where the channel table says its topic is keyed by request id."""
    rid = getattr(ce.event, "request_id", None)
    if isinstance(rid, str) and rid:
        return rid
    return ce.key_str if topics.keyed_by_request(ce.topic) else None


def dead_letter_reporter(
    publisher: Publisher,
    topics: Topics,
    stage: str,
    *,
    record: StatusWriter | None = None,
) -> DeadLetterHook:
    """A ConsumeLoop hook that emits ``rejected``/``failed`` for the dead-lettered request
    (``record``: also written through to its status record, as the stages' updates are)."""
    reporter = ResultReporter(publisher, topics.results, stage, record=record)

    async def report(ce: ConsumedEvent, info: ErrorInfo) -> None:
        rid = request_id_of(ce, topics)
        if rid is None:
            return
        await reporter(
            rid,
            _status_of(info.code),
            error=info,
            info={"dlq": f"{ce.topic}[{ce.partition}]@{ce.offset}"},
        )

    return report
