"""The lifecycle pieces of one prefill or decode worker, built once from its context."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_workers.lifecycle.admission import AdmissionGate
from gpu_workers.lifecycle.embeddings import EmbeddingWait
from gpu_workers.lifecycle.outcomes import Outcomes, Tally
from gpu_workers.lifecycle.record_watch import RecordWatch
from runtime.reporting import RequestUpdates

if TYPE_CHECKING:
    from gpu_workers.context import WorkerContext
    from runtime.reporting import ResultReporter
    from runtime.status import RequestStateReader


@dataclass(slots=True)
class RequestLifecycle:
    """What a worker does to a request around its compute: admit it, gather its embeddings,
    watch its record, report its end (and count how it ended)."""

    worker_id: str
    tally: Tally
    outcomes: Outcomes
    watch: RecordWatch
    report: ResultReporter
    """The worker's status updates (a write that finds the record gone tells ``watch``)."""
    gate: AdmissionGate
    embeddings: EmbeddingWait
    hold_s: float = 0.0
    """How long a progress update waits for the ones behind it (``EPD_STATUS_HOLD_MS``)."""

    @classmethod
    def build(
        cls,
        ctx: WorkerContext,
        stage: str,
        *,
        embedding_wait_s: float | None = None,
        request_state: RequestStateReader | None = None,
    ) -> RequestLifecycle:
        """The pieces for a worker reporting as ``stage``.

        ``request_state`` reads the request's status record: a request whose record is already
        terminal (a redelivered event) is skipped without a word, a missing embedding is told
        lost (reported ``failed``, ``embedding-lost``) or still coming (waited for), and a
        decoding request whose record went stops. ``embedding_wait_s``: how long a missing
        embedding is waited for (``EPD_EMBEDDING_WAIT_S`` when None)."""
        worker_id = ctx.name(stage)
        tally = Tally()
        outcomes = Outcomes(tally)
        watch = RecordWatch(request_state, worker_id)
        settings = ctx.settings
        wait_s = settings.embedding_wait_s if embedding_wait_s is None else embedding_wait_s
        return cls(
            worker_id,
            tally,
            outcomes,
            watch,
            ctx.reporter(stage, on_gone=watch.on_gone_event),
            AdmissionGate(
                ctx,
                outcomes,
                worker_id=worker_id,
                request_state=request_state,
                on_record=watch.admitted,
            ),
            EmbeddingWait(
                ctx.store,
                ctx.bundle.family,
                outcomes,
                wait_s=wait_s,
                recheck_s=settings.embedding_recheck_s,
                cancel=ctx.cancel,
                request_state=request_state,
            ),
            hold_s=settings.status_hold_ms / 1000,
        )

    async def run(self, request_id: str, body: Callable[[RequestUpdates], Awaitable[None]]) -> None:
        """Run ``body`` with the request's updates: sent in order, all of them out before this
        returns; those still on their way when ``body`` raises are abandoned."""
        updates = RequestUpdates(self.report, request_id, hold_s=self.hold_s)
        try:
            await body(updates)
        except BaseException:
            await updates.abandon()
            raise
        await updates.flush()

    async def close(self) -> None:
        await self.watch.close()
