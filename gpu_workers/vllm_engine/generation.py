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
from gpu_workers.generation import Generation, generation_of, open_stream, watched
from gpu_workers.sampling import request_seed
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
ABORT_WAIT_S = 5.0
"""Longest a stop waits on vLLM's abort call before the request ends anyway."""


def seeded_body(ev: PrefillEvent, model: str | None) -> dict[str, object]:
    """:func:`generate_body` with the reference engine's seed on a sampled request (its own, or
    one derived from the request id): vLLM would draw an unseeded request at random, and a
    retried request would then continue its token stream with another generation's tokens."""
    body = generate_body(ev, model=model)
    if ev.sampling.temperature > 0:
        sampling = body["sampling_params"]
        sampling["seed"] = request_seed(ev.sampling, ev.request_id)
    return body


async def _cancel(task: asyncio.Task[object]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


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
        body = seeded_body(ev, self.model)
        seq = new_sequence(self.ctx.bundle, ev.sampling, rid)
        stream = await open_stream(self.streams, self.watch, rid)
        drive = self._drive(ev, body, seq, stream, updates)
        (outcome, detail), gone = await watched(self.watch, ev, stream, drive)
        return generation_of(outcome, detail, seq, t0, stream, gone)

    async def _drive(
        self,
        ev: PrefillEvent,
        body: dict[str, object],
        seq: DecodeState,
        stream: TokenStreamWriter | None,
        updates: RequestUpdates,
    ) -> tuple[str, str]:
        """Read vLLM's stream while watching for a stop; (outcome, detail)."""
        stopped = asyncio.Event()
        reader = asyncio.create_task(self._read(body, seq, stream, updates, stopped))
        try:
            while True:
                done, _ = await asyncio.wait({reader}, timeout=POLL_S)
                if done:
                    return reader.result()
                stop = self._stop_asked(ev)
                if stop is not None:
                    # No token is taken after the stop (however long vLLM takes to hear the
                    # abort: a hung instance is when one cancels); the abort is told while the
                    # request still runs there, then the stream is closed.
                    stopped.set()
                    await self._abort(ev.request_id)
                    return stop
        finally:
            await _cancel(reader)

    async def _read(
        self,
        body: dict[str, object],
        seq: DecodeState,
        stream: TokenStreamWriter | None,
        updates: RequestUpdates,
        stopped: asyncio.Event,
    ) -> tuple[str, str]:
        started = False
        rid = seq.request_id
        # Closed as soon as the request ends here (a return mid-stream would otherwise hold
        # vLLM's connection open until the generator is collected).
        async with contextlib.aclosing(self.client.generate(body)) as replies:
            async for out in replies:
                if stopped.is_set():  # _drive ends the request; nothing more is taken
                    return CANCELLED, "stopped"
                if out.token_ids and not started:
                    started = True
                    updates.soon("decoding")
                for tok in out.token_ids:
                    if seq.accept(tok):
                        break
                if out.finish_reason == FINISH_ABORT:
                    raise VllmUnavailable(f"vLLM aborted {rid} without being asked to")
                if out.finish_reason is not None and not seq.done:
                    # vLLM ended it where we would not (e.g. its generation config's eos)
                    seq.settle()
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
        """Tell vLLM to stop, waiting at most ``ABORT_WAIT_S`` (the stream's close, which
        :func:`_cancel` did, aborts it in vLLM too)."""
        self.aborts_sent += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.client.abort(request_id), ABORT_WAIT_S)
