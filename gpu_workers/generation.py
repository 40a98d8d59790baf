"""An admitted request in the worker's decode batch: from its start to its last token.

The model compute runs on the engine's one compute thread, where every request the worker holds
decodes in one batch (:mod:`gpu_workers.engine`: a forward per step over all of them, each
stopping at its own end, deadline or cancel); tokens are streamed as they come
(:mod:`runtime.token_stream`). The prefill worker starts a request from its prompt and
embeddings, the decode worker from a parked KV cache (or the prompt again); both decode here.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from gpu_workers.engine import CANCELLED, COMPLETED, DecodeJob, new_sequence

if TYPE_CHECKING:
    from gpu_workers.compute import Prefilled
    from gpu_workers.context import WorkerContext
    from gpu_workers.engine import DecodeEngine
    from gpu_workers.lifecycle.record_watch import RecordWatch
    from gpu_workers.sequence import DecodeState
    from runtime.reporting import RequestUpdates
    from runtime.token_stream import TokenStreams, TokenStreamWriter
    from schemas.types import PrefillEvent

T = TypeVar("T")


@dataclass(slots=True)
class Generation:
    """What the decode batch made of an admitted request."""

    outcome: str
    """``completed``, ``cancelled`` or ``expired``: the status it is reported with."""
    tokens: list[int]
    """Every token generated (for a stopped request, the ones made before it stopped)."""
    detail: str = ""
    compute_ms: float = 0.0
    text: str = ""
    """The tokens' text (cut at a stop string)."""
    finish_reason: str | None = None
    """``stop`` or ``length`` once completed."""
    stream: TokenStreamWriter | None = None
    """The request's token stream, still to be ended."""
    gone: bool = False
    """Stopped because the request's status record went while it decoded
    (:class:`~gpu_workers.lifecycle.record_watch.RecordWatch`)."""


async def open_stream(
    streams: TokenStreams | None, watch: RecordWatch, request_id: str
) -> TokenStreamWriter | None:
    """The request's token stream, resumed where an earlier run of it left it (None without
    token streams). A worker that reads records guards its token writes by the record: none
    lands once it went, and that is how a decoding request learns it
    (``RecordWatch.on_gone``)."""
    if streams is None:
        return None
    on_gone = watch.on_gone if watch.reads_records else None
    stream = streams.writer(request_id, on_gone)
    await stream.resume()
    return stream


async def watched(
    watch: RecordWatch,
    ev: PrefillEvent,
    stream: TokenStreamWriter | None,
    work: Awaitable[T],
) -> tuple[T, bool]:
    """``work``'s result while ``watch`` tracks the request, and whether its record went
    meanwhile; on a failure the token stream is abandoned (a retry resumes it)."""
    watch.track(ev.request_id, ev.created_ms)
    try:
        result = await work
    except BaseException:
        if stream is not None:
            await stream.abandon()
        raise
    finally:
        gone = watch.untrack(ev.request_id)
    return result, gone


def generation_of(
    outcome: str,
    detail: str,
    seq: DecodeState,
    started_s: float,
    stream: TokenStreamWriter | None,
    gone: bool,
) -> Generation:
    """The :class:`Generation` of a finished ``seq`` (``started_s``: its
    ``time.perf_counter()`` at the start; ``gone``: its record went while it ran)."""
    seq.settle()
    return Generation(
        outcome,
        seq.tokens,
        detail,
        compute_ms=(time.perf_counter() - started_s) * 1000,
        text=seq.text,
        finish_reason=seq.finish_reason if outcome == COMPLETED else None,
        stream=stream,
        gone=gone and outcome == CANCELLED,
    )


class Generator:
    """Decodes admitted requests in the worker's batch (``engine``), streaming their tokens."""

    def __init__(
        self,
        ctx: WorkerContext,
        engine: DecodeEngine,
        watch: RecordWatch,
        *,
        streams: TokenStreams | None = None,
    ) -> None:
        """``streams``: each request's tokens are written to its token stream while it decodes
        (:mod:`runtime.token_stream`), ended (by the outcome's reporter) before its terminal
        status. ``watch``: a request whose record went stops at its next step."""
        self.bundle = ctx.bundle
        self.cancel = ctx.cancel
        self.engine = engine
        self.watch = watch
        self.streams = streams

    async def run(
        self, ev: PrefillEvent, start: Callable[[], Prefilled], updates: RequestUpdates
    ) -> Generation:
        """Decode ``ev`` from ``start`` (run on the compute thread as it joins the batch) to
        ``max_tokens``, a stop token or string, the deadline or a cancel (asked before the
        start and between steps), streaming its tokens as they come."""
        t_compute = time.perf_counter()
        rid = ev.request_id
        seq = new_sequence(self.bundle, ev.sampling, rid)
        stream = await open_stream(self.streams, self.watch, rid)
        job = DecodeJob(
            rid,
            seq,
            start,
            kv_tokens=len(ev.token_ids) + ev.sampling.max_tokens,
            deadline_ms=ev.deadline_ms,
            should_stop=self._stop_asked(rid),
            on_tokens=stream.push if stream is not None else None,
            # Sent in the background while the batch decodes.
            on_started=lambda: updates.soon("decoding"),
        )
        done, gone = await watched(self.watch, ev, stream, self.engine.run(job))
        return generation_of(done.outcome, done.detail, seq, t_compute, stream, gone)

    def _stop_asked(self, request_id: str) -> Callable[[], bool]:
        """Asked on the compute thread before the start and between steps: set lookups."""
        gone, cancel = self.watch.gone, self.cancel
        return lambda: (
            request_id in gone or (cancel is not None and cancel.cancelled_now(request_id))
        )
