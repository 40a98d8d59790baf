"""How a prefill or decode worker's request ends: one reporter per ending, and their tally.

Every ending is one status update through the request's :class:`~runtime.reporting.RequestUpdates`
(in order after its progress updates): completed with its tokens, text, timings and finish
reason; cancelled (the tokens made before the cancel took effect kept); expired; failed because
an embedding is missing past the wait or lost for good. A rejection is not reported here: it is
a ``ValidationError`` raised to the consume loop, which dead-letters the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas.types import ErrorInfo, PrefillEvent, now_ms
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from gpu_workers.generation import Generation
    from runtime.reporting import RequestUpdates

GONE_DETAIL = (
    "the request's status record went while it decoded (its TTL, an eviction, an operator); "
    "nobody can read its outcome"
)


@dataclass(slots=True)
class Tally:
    """What a worker's requests came to, counted (read by tests and benchmarks)."""

    completed: int = 0
    cancelled: int = 0
    skipped: int = 0
    """Not run: a redelivery of a finished request, or a second event of one running here."""
    lost: int = 0
    """Ended ``embedding-lost``."""
    handed_off: int = 0
    """Prefilled and handed to a decode worker (``EPD_DECODE_STAGE``)."""
    from_kv: int = 0
    """Decoded from a parked KV cache (a decode worker)."""
    prefilled_again: int = 0
    """Decoded after running the prefill again, the parked cache gone (a decode worker)."""


class Outcomes:
    """Reports each way a request ends, counting it in ``tally``."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally

    async def finished(
        self,
        ev: PrefillEvent,
        result: Generation,
        timings: dict[str, float],
        updates: RequestUpdates,
        info: dict[str, str] | None = None,
    ) -> None:
        """The outcome of a request that decoded, with its tokens and text (a stopped or
        expired request's partial output included) and, once completed, its timings, finish
        reason and ``info``. The token stream ends first, so a terminal record means a complete
        stream."""
        if result.stream is not None:
            await result.stream.close(result.outcome, result.finish_reason)
        if result.gone:
            await self.cancelled(
                updates, GONE_DETAIL, result.tokens, result.text, code="status-gone"
            )
            return
        if result.outcome == "cancelled":
            await self.cancelled(updates, result.detail, result.tokens, result.text)
            return
        if result.outcome == "expired":
            await updates.now(
                "expired",
                token_ids=result.tokens,
                text=result.text,
                error=ErrorInfo("expired", result.detail),
            )
            return
        self.tally.completed += 1
        await updates.now(
            "completed",
            token_ids=result.tokens,
            text=result.text,
            timings={
                **timings,
                "prefill_decode": result.compute_ms,
                "total": float(now_ms() - ev.created_ms),
            },
            info={"finish_reason": result.finish_reason or "", **(info or {})},
        )

    async def expired(self, updates: RequestUpdates, before: str) -> None:
        """``expired``: the deadline passed before ``before`` (``prefill``) ran."""
        await updates.now("expired", error=ErrorInfo("expired", f"deadline passed before {before}"))

    async def cancelled(
        self,
        updates: RequestUpdates,
        what: str,
        tokens: list[int] | None = None,
        text: str | None = None,
        *,
        code: str = "cancelled",
    ) -> None:
        """``cancelled``, with the tokens made before the cancel took effect (if any);
        ``code`` ``status-gone``: stopped because the request's record went."""
        self.tally.cancelled += 1
        await updates.now(
            "cancelled",
            token_ids=tokens or None,
            text=text if tokens else None,
            error=ErrorInfo(code, f"cancelled: {what}"),
            # info survives in the record even though the API's cancel was the terminal status
            info={"prefill.cancelled": what},
        )

    async def missing(
        self,
        ev: PrefillEvent,
        keys: dict[str, str],
        missing_keys: set[str],
        waited_s: float,
        updates: RequestUpdates,
    ) -> None:
        """The embedding wait ran out: ``failed`` (``expired`` past the deadline), naming the
        first missing item (modality and index), as every rejection does."""
        missing = [h for h, k in keys.items() if k in missing_keys]
        modality, index = next(
            ((m, i) for m, i, h in ev.features.items() if keys[h] in missing_keys),
            (None, None),
        )
        await updates.now(
            "expired" if deadline_passed(ev.deadline_ms, now_ms()) else "failed",
            error=ErrorInfo(
                "embeddings-missing",
                f"embeddings for {len(missing)} item(s) not in the store after {waited_s:.1f}s: "
                + ", ".join(h[:16] for h in missing),
                modality=modality,
                item=index,
            ),
        )

    async def lost(self, ev: PrefillEvent, lost: list[str], updates: RequestUpdates) -> None:
        """``failed``, ``embedding-lost``, naming the first lost item."""
        modality, index = next(
            ((m, i) for m, i, h in ev.features.items() if h in lost), (None, None)
        )
        self.tally.lost += 1
        await updates.now(
            "failed",
            error=ErrorInfo(
                "embedding-lost",
                f"embeddings for {len(lost)} item(s) are gone from the store and cannot arrive "
                "any more (evicted after they were stored, or lost with a Redis restart): "
                + ", ".join(h[:16] for h in lost),
                modality=modality,
                item=index,
            ),
        )
