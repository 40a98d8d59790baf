"""Prefill worker: PrefillEvents -> wait for embeddings -> splice -> prefill + decode.

A thin worker over two layers: the request lifecycle (:mod:`gpu_workers.lifecycle`: admission
with the door's own bounds, the embedding wait, the outcome) and the compute
(:mod:`gpu_workers.backends`, ``EPD_ENGINE``: :mod:`gpu_workers.generation` over
:mod:`gpu_workers.engine` and :mod:`gpu_workers.compute`, prefill, then decode in the worker's
batch; or a vLLM instance; tokens streamed as they come).
With the decode stage on, the worker parks the KV cache and hands the request to a decode
worker (:mod:`gpu_workers.decode`) instead of decoding it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from gpu_workers.backends import ReferenceBackend, prefill_backend
from gpu_workers.compute import ItemEmbedding, Prefilled
from gpu_workers.engine import CANCELLED, EXPIRED
from gpu_workers.entries import items_from_features
from gpu_workers.kv_handoff import kv_entry, kv_tensors, park
from gpu_workers.lifecycle.parts import RequestLifecycle
from runtime.publisher import publish
from schemas.status_record import HANDOFF_INFO
from schemas.types import DecodeEvent, PrefillEvent, now_ms
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from gpu_workers.context import WorkerContext
    from runtime.reporting import RequestUpdates
    from runtime.status import RequestStateReader
    from runtime.token_stream import TokenStreams

Parked = tuple[Prefilled, dict[str, torch.Tensor], float]
"""A prompt run for the hand-off: its state, its KV tensors and the prefill's milliseconds."""


class PrefillWorker:
    """Handles PrefillEvents; plug :meth:`handle` into a ConsumeLoop.

    A request is admitted (:class:`~gpu_workers.lifecycle.admission.AdmissionGate`), its
    embeddings gathered (:class:`~gpu_workers.lifecycle.embeddings.EmbeddingWait`), then
    prefilled and decoded in the worker's batch (:class:`~gpu_workers.generation.Generator`)
    and its outcome reported (:class:`~gpu_workers.lifecycle.outcomes.Outcomes`). A phase that
    ends the request early reports why itself. With the decode stage on
    (``EPD_DECODE_STAGE``), :meth:`_hand_off` replaces the last two: the KV cache is parked and
    the request handed to a decode worker.
    """

    STAGE = "prefill"
    """The stage name on this worker's status updates."""

    def __init__(
        self,
        ctx: WorkerContext,
        *,
        embedding_wait_s: float | None = None,
        request_state: RequestStateReader | None = None,
        streams: TokenStreams | None = None,
    ) -> None:
        """``ctx.cancel``: asked before the embedding wait, before compute and between decode
        steps; a cancelled request is reported ``cancelled`` (with the tokens made before the
        cancel took effect) and its work is skipped. ``request_state``, ``embedding_wait_s``:
        see :meth:`RequestLifecycle.build`; ``streams``: the token streams the backend writes
        (:mod:`gpu_workers.backends`)."""
        self.ctx = ctx
        self.life = RequestLifecycle.build(
            ctx, self.STAGE, embedding_wait_s=embedding_wait_s, request_state=request_state
        )
        self.worker_id = self.life.worker_id
        self.tally = self.life.tally
        # The engine seam (EPD_ENGINE): the reference engine's compute thread runs the batch
        # (requests decode together, one forward per step), or a vLLM instance does.
        self.backend = prefill_backend(ctx, self.life.watch, streams)
        if isinstance(self.backend, ReferenceBackend):
            self.engine = self.backend.engine  # the decode stage's hand-off runs on it

    async def close(self) -> None:
        await self.life.close()
        await self.backend.close()

    async def handle(self, ev: PrefillEvent) -> None:
        """Run one request to completion (or to a clear failure)."""
        await self.life.run(ev.request_id, lambda updates: self._run(ev, updates))

    async def _run(self, ev: PrefillEvent, updates: RequestUpdates) -> None:
        life = self.life
        admitted = await life.gate.admit(ev, updates)
        if admitted is None:
            return
        # Progress updates go out in the background: the request does not wait for the
        # broker's acknowledgement or the record write before its own work.
        updates.soon("prefilling")
        t_wait = time.perf_counter()
        outputs = await life.embeddings.collect(ev, admitted, updates)
        if outputs is None:
            return
        timings = {
            "queue": float(admitted.started_ms - ev.created_ms),
            **({"broker_hop": admitted.hop_ms} if admitted.hop_ms is not None else {}),
            "admission": (t_wait - admitted.t_start) * 1000,
            "embedding_wait": (time.perf_counter() - t_wait) * 1000,
        }
        items = items_from_features(ev.features, dict(zip(admitted.keys, outputs, strict=True)))
        if self.ctx.settings.decode_stage:
            await self._hand_off(ev, items, timings, updates)
            return
        result = await self.backend.generate(ev, items, updates)
        if result.outcome == "completed" and not result.gone:
            await life.embeddings.marks_landed(ev, admitted)
        await life.outcomes.finished(ev, result, timings, updates)

    # ------------------------------------------------------------------------- hand off

    async def _hand_off(
        self,
        ev: PrefillEvent,
        items: list[ItemEmbedding],
        timings: dict[str, float],
        updates: RequestUpdates,
    ) -> None:
        """The decode stage (``EPD_DECODE_STAGE``): run the prompt, park its KV cache in the
        store (signed, bound to the request, with a TTL) and hand the request to the decode
        workers (a ``DecodeEvent`` on ``{prefix}.decode``, keyed by request id). The request
        stays ``prefilling`` here; the decode worker reports the rest."""
        done = await self.engine.call(lambda: self._prefill_for_handoff(ev, items))
        if done == CANCELLED:
            await self.life.outcomes.cancelled(updates, "skipped before prefill")
            return
        if done == EXPIRED:
            await self.life.outcomes.expired(updates, "prefill")
            return
        assert not isinstance(done, str)
        state, tensors, prefill_ms = done
        ctx = self.ctx
        kv = kv_entry(ctx.settings, ctx.bundle, ctx.store, ev.request_id, state, ev.deadline_ms)
        t_park = time.perf_counter()
        await park(ctx.store, kv, tensors)
        park_ms = (time.perf_counter() - t_park) * 1000
        handoff = DecodeEvent(prefill=ev, kv=kv, kv_transfer_params=ev.kv_transfer_params)
        await updates.flush()  # a held "prefilling" must not land after the decode worker's word
        await publish(ctx.publisher, ctx.topics, handoff)
        self.tally.handed_off += 1
        await updates.now(
            "prefilling",
            timings={**timings, "prefill": prefill_ms, "kv_park": park_ms},
            info={HANDOFF_INFO: "decode", "kv_bytes": str(kv.nbytes)},
        )

    def _prefill_for_handoff(self, ev: PrefillEvent, items: list[ItemEmbedding]) -> Parked | str:
        """On the compute thread: the prompt run and its KV tensors, unless the request was
        cancelled or expired by the time the thread takes it up (asked as a batch asks)."""
        cancel, rid = self.ctx.cancel, ev.request_id
        if cancel is not None and cancel.cancelled_now(rid):
            return CANCELLED
        if deadline_passed(ev.deadline_ms, now_ms()):
            return EXPIRED
        t0 = time.perf_counter()
        state = self.engine.prefill(ev.token_ids, items)
        return state, kv_tensors(state), (time.perf_counter() - t0) * 1000
