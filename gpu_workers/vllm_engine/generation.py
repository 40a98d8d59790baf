"""The prefill + decode of an admitted request on a vLLM instance (``EPD_ENGINE=vllm``).

The request goes to vLLM's ``/inference/v1/generate`` as :func:`schemas.vllm_generate.
generate_body` writes it (metadata-only items with their signed EC entries: vLLM's EC connector
brings the embeddings from our store), and its streamed tokens come back into the request's
token stream and its :class:`~gpu_workers.generation.Generation`, which the worker reports as
the reference engine's (:class:`~gpu_workers.lifecycle.outcomes.Outcomes`). The text is ours:
each token goes through the request's :class:`~gpu_workers.sequence.DecodeState` (our tokenizer,
stop strings and stop tokens), so text, stop-string cuts and finish reasons read the same on
both engines; should vLLM go on past where our state ends it, the request is aborted there.

A cancel, the deadline or the request's record going is asked every ``POLL_S`` while vLLM
generates; any of them sends vLLM ``/inference/v1/abort_requests`` and ends the request as the
reference engine does (``cancelled`` or ``expired``, with the tokens made so far).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from gpu_workers.engine import CANCELLED, COMPLETED, EXPIRED, new_sequence
from gpu_workers.generation import Generation
from schemas.types import now_ms
from schemas.values import deadline_passed
from schemas.vllm_generate import FINISH_ABORT, VllmUnavailable, generate_body

if TYPE_CHECKING:
    from gpu_workers.context import WorkerContext
    from gpu_workers.lifecycle.record_watch import RecordWatch
    from gpu_workers.sequence import DecodeState
    from gpu_workers.vllm_engine.client import VllmClient
    from runtime.reporting import RequestUpdates
    from runtime.token_stream import TokenStreams, TokenStreamWriter
    from schemas.types import PrefillEvent

POLL_S = 0.05
"""How often a cancel, the deadline and the record are asked while vLLM generates."""


class VllmGenerator:
    """Runs admitted requests on vLLM, streaming their tokens (the vLLM side of the seam)."""

    def __init__(
        self,
        ctx: WorkerContext,
        client: VllmClient,
        watch: RecordWatch,
        *,
        streams: TokenStreams | None = None,
    ) -> None:
        self.ctx = ctx
        self.client = client
        self.watch = watch
        self.streams = streams
        self.model = ctx.settings.vllm_model or None
        self.aborts_sent = 0

    async def run(self, ev: PrefillEvent, updates: RequestUpdates) -> Generation:
        """``ev`` generated on vLLM to its end, a cancel or the deadline."""
        t0 = time.perf_counter()
        rid = ev.request_id
        body = generate_body(ev, model=self.model)
        seq = new_sequence(self.ctx.bundle, ev.sampling, rid)
        stream = await self._stream(rid)
        self.watch.track(rid, ev.created_ms)
        try:
            outcome, detail = await self._drive(ev, body, seq, stream, updates)
        except BaseException:
            if stream is not None:
                await stream.abandon()
            raise
        finally:
            gone = self.watch.untrack(rid)
        seq.settle()
        return Generation(
            outcome,
            seq.tokens,
            detail,
            compute_ms=(time.perf_counter() - t0) * 1000,
            text=seq.text,
            finish_reason=seq.finish_reason if outcome == COMPLETED else None,
            stream=stream,
            gone=gone and outcome == CANCELLED,
        )

    async def _drive(
        self,
        ev: PrefillEvent,
        body: dict[str, object],
        seq: DecodeState,
        stream: TokenStreamWriter | None,
        updates: RequestUpdates,
    ) -> tuple[str, str]:
        """Read vLLM's stream while watching for a stop; (outcome, detail)."""
        reader = asyncio.create_task(self._read(body, seq, stream, updates))
        try:
            while True:
                done, _ = await asyncio.wait({reader}, timeout=POLL_S)
                if done:
                    return reader.result()
                stop = self._stop_asked(ev)
                if stop is not None:
                    await self._abort(ev.request_id)
                    return stop
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader

    async def _read(
        self,
        body: dict[str, object],
        seq: DecodeState,
        stream: TokenStreamWriter | None,
        updates: RequestUpdates,
    ) -> tuple[str, str]:
        started = False
        rid = seq.request_id
        async for out in self.client.generate(body):
            if out.token_ids and not started:
                started = True
                updates.soon("decoding")
            for tok in out.token_ids:
                if seq.accept(tok):
                    break
            if out.finish_reason == FINISH_ABORT:
                raise VllmUnavailable(f"vLLM aborted {rid} without being asked to")
            if out.finish_reason is not None and not seq.done:
                seq.settle()  # vLLM ended it where we would not (e.g. its generation config's eos)
                seq.finish_reason = out.finish_reason
            if stream is not None:
                stream.push(*seq.take_new())
            if seq.done:
                if out.finish_reason is None:
                    await self._abort(rid)  # our stop string or stop token ended it first
                return COMPLETED, ""
        raise VllmUnavailable(f"vLLM's stream of {rid} ended without a finish reason")

    def _stop_asked(self, ev: PrefillEvent) -> tuple[str, str] | None:
        rid, cancel = ev.request_id, self.ctx.cancel
        if rid in self.watch.gone or (cancel is not None and cancel.cancelled_now(rid)):
            return CANCELLED, "stopped while vLLM generated"
        if deadline_passed(ev.deadline_ms, now_ms()):
            return EXPIRED, "deadline passed while vLLM generated"
        return None

    async def _abort(self, request_id: str) -> None:
        self.aborts_sent += 1
        await self.client.abort(request_id)

    async def _stream(self, request_id: str) -> TokenStreamWriter | None:
        """The request's token stream, resumed where an earlier try left it (a retried request
        is generated again from the start; the stream skips what it already holds)."""
        if self.streams is None:
            return None
        on_gone = self.watch.on_gone if self.watch.reads_records else None
        stream = self.streams.writer(request_id, on_gone)
        await stream.resume()
        return stream
