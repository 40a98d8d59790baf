"""Encode worker: EncodeEvents -> vision tower (micro-batched) -> embedding store -> EncodedEvent.

A store hit, or the same mm_hash already being encoded by this worker, never runs the encoder
a second time. Encode events are keyed by mm_hash, so repeats of one image land on one
partition, hence on one worker, where its single flight (:mod:`gpu_workers.single_flight`) sees
them.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpu_workers.batcher import MicroBatcher
from gpu_workers.compute import EncoderOutput, encode_items
from gpu_workers.encoder_inputs import EncoderInputs, InputLost, check_patch_width, encoder_fields
from gpu_workers.entries import request_cancelled, store_outputs
from gpu_workers.instant import instant_encode
from gpu_workers.metrics import encode_metrics
from gpu_workers.single_flight import SingleFlight
from gpu_workers.vllm_engine.encode import VllmEncoder
from runtime.publisher import publish
from runtime.reporting import recorded_headers
from runtime.tracing import broker_hop_ms
from schemas.families import EMBEDS
from schemas.status_record import encoded_update
from schemas.tensors import dtype_name
from schemas.types import EncodedEvent, EncodeEvent, ErrorInfo, now_ms
from schemas.validator import validate_encode_event
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from gpu_workers.context import WorkerContext

Job = tuple[torch.Tensor, torch.Tensor]


class EncodeWorker:
    """Handles EncodeEvents; plug :meth:`handle` into a ConsumeLoop.

    Composes the item's inputs (:class:`~gpu_workers.encoder_inputs.EncoderInputs`), a single
    flight per item, the micro-batched vision tower (:class:`~gpu_workers.batcher.MicroBatcher`
    over :func:`~gpu_workers.compute.encode_items`) and the entry format
    (:mod:`gpu_workers.entries`).
    """

    STAGE = "encode"
    """The stage name on this worker's status updates."""

    def __init__(self, ctx: WorkerContext, *, registry: CollectorRegistry | None = None) -> None:
        """``ctx.cancel``: asked (beside the store lookup) before any input is read or encoded;
        a cancelled request's item is skipped and reported ``cancelled``. The event is
        validated first, so an unsafe one goes to the DLQ whatever its request's state.

        ``ctx.record``: each item's encoded (or cached) mark, and every status update, is also
        written to the request's status record directly, so the request's outcome never shows
        up before its items' encode timings. ``registry``: the worker's /metrics (None:
        private series)."""
        self.ctx = ctx
        self.settings = ctx.settings
        self.bundle = ctx.bundle
        self.store = ctx.store
        self.worker_id = ctx.name(self.STAGE)
        self.vconfig = ctx.validation()
        self.report = ctx.reporter(self.STAGE)
        self.metrics = encode_metrics(registry)
        self.inputs = EncoderInputs(
            ctx.store,
            ctx.settings.ec_namespace,
            self.vconfig,
            self.metrics.bytes_in,
            worker_id=self.worker_id,
        )
        self.batcher: MicroBatcher[Job, EncoderOutput] = MicroBatcher(
            self._compute, max_cost=ctx.settings.encode_batch_patches
        )
        # The engine seam (EPD_ENGINE): our vision tower in the batcher, or vLLM encoders.
        self.vllm = VllmEncoder(ctx) if ctx.settings.engine == "vllm" else None
        self.flights: SingleFlight[str] = SingleFlight()
        """Items being encoded now, by store key: a second event of one waits for the first."""
        self.cache_hits = 0
        self.items_encoded = 0
        self.skipped_cancelled = 0

    @property
    def encoder_calls(self) -> int:
        """Vision-tower calls made so far (one per micro-batch)."""
        return self.batcher.batches

    @property
    def claims_deleted(self) -> int:
        """Claim-checked inputs deleted once their item's embedding was stored."""
        return self.inputs.deleted

    def _compute(self, jobs: Sequence[Job]) -> list[EncoderOutput]:
        encode = instant_encode if self.bundle.instant else encode_items
        return encode(self.bundle, jobs)

    async def close(self) -> None:
        await self.batcher.close()
        if self.vllm is not None:
            await self.vllm.close()

    async def _encoded(
        self,
        ev: EncodeEvent,
        emb_dtype: str,
        shape: list[int],
        *,
        hit: bool,
        ms: float,
        hop_ms: float | None = None,
    ) -> None:
        encoded = EncodedEvent(
            mm_hash=ev.mm_hash,
            request_id=ev.request_id,
            model=ev.model,
            store=self.store.url,
            key=ev.ec_transfer.key,
            dtype=emb_dtype,
            shape=shape,
            cache_hit=hit,
            encode_ms=ms,
        )
        # They mark the item encoded in its request's status: in the record at once (with a
        # record writer), and through the results collector, which reads the topic (and folds
        # the mark only where the record did not take it).
        recorded = await self.report.write_through(encoded_update(encoded, hop_ms=hop_ms))
        await publish(
            self.ctx.publisher, self.ctx.topics, encoded, headers=recorded_headers(recorded)
        )

    async def handle(self, ev: EncodeEvent) -> None:
        """Encode one item (or find it already encoded) and announce it. An input lost with
        the store is reported ``failed`` (``input-lost``): a failure of ours, not a rejection.

        Phases: the deadline, then validation, then the item's single flight (another event of
        the same item being encoded here is waited for, and its work counts as a hit), then
        :meth:`_lookup_or_encode` and storing inside the flight, then :meth:`_finish`."""
        try:
            await self._handle(ev)
        except InputLost as lost:
            await self.report(ev.request_id, "failed", error=lost.info)

    async def _handle(self, ev: EncodeEvent) -> None:
        # The deadline comes first: the fan-out caps ec_transfer expiry at the deadline, so a late
        # event would otherwise fail validation as ec-expired (rejected) instead of expiring.
        # Nothing is read or computed on this path.
        if deadline_passed(ev.deadline_ms, now_ms()):
            await self._report_expired(ev)
            return
        hop_ms = broker_hop_ms(now_ms())
        validate_encode_event(ev, self.vconfig)
        pv_name, grid_name = encoder_fields(ev, self.bundle)
        flight = await self.flights.join(ev.ec_transfer.key)
        if flight is None:
            # The same item was encoded meanwhile, by another event of this worker.
            await self._finish(ev, Lookup(Found.HIT), hop_ms)
            return
        with flight:
            found = await self._lookup_or_encode(ev, pv_name, grid_name)
            if found.kind is Found.CANCELLED:
                flight.give_up()  # waiters on this item take over instead of counting a hit
            elif found.kind is Found.ENCODED:
                # Inside the flight: a waiter told "done" must find the entry in the store.
                await self._store(ev, found)
        await self._finish(ev, found, hop_ms)

    async def _lookup_or_encode(self, ev: EncodeEvent, pv_name: str, grid_name: str) -> Lookup:
        """The item's embedding already in the store (a hit, whose TTL is extended: the
        EncodedEvent tells prefill it is there), its request cancelled, or the vision tower's
        output for it (micro-batched with other items)."""
        # The inputs are read (and checked) beside the cancel flag and the store lookup, which
        # share one round trip: a miss, the usual case (the fan-out looked already), waits for
        # neither in turn. A hit or a cancel drops them unread by anyone.
        inputs = asyncio.ensure_future(self.inputs.read(ev, pv_name, grid_name))
        t0 = time.perf_counter()
        # A batch being formed waits for this item while its inputs arrive (a hit or a cancel
        # withdraws it on leaving the block).
        with self.batcher.on_the_way():
            try:
                cancelled, hit = await asyncio.gather(
                    request_cancelled(self.ctx.cancel, ev.request_id),
                    self.store.touch(ev.ec_transfer.key, self.settings.embedding_ttl_s),
                )
            except BaseException:
                await _discard(inputs)
                raise
            if cancelled or hit:
                await _discard(inputs)
                return Lookup(Found.CANCELLED if cancelled else Found.HIT)
            pixels, grid = await inputs
            check_patch_width(pixels, pv_name, ev, self.bundle)
            if self.vllm is not None:
                # vLLM's EC connector writes the entry; what comes back is read from our store.
                out = await self.vllm.encode(ev, {pv_name: pixels, grid_name: grid}, grid_name)
            else:
                out = await self.batcher.submit((pixels, grid), cost=int(pixels.shape[0]))
        return Lookup(Found.ENCODED, out, t0)

    async def _store(self, ev: EncodeEvent, found: Lookup) -> None:
        """Write the item's entry: the embedding and any other outputs (deepstack) together."""
        out = found.outputs
        assert out is not None
        if self.vllm is None:  # else vLLM's EC connector wrote it (and it was read back)
            await store_outputs(
                self.store,
                ev.ec_transfer.key,
                out,
                self.bundle.family,
                self.settings.embedding_ttl_s,
            )
        found.ms = (time.perf_counter() - found.t0) * 1000
        self.items_encoded += 1
        self.metrics.items.labels("miss").inc()
        self.metrics.bytes_out.inc(sum(t.numel() * t.element_size() for t in out.values()))

    async def _finish(self, ev: EncodeEvent, found: Lookup, hop_ms: float | None) -> None:
        """Report the item: ``cancelled``, or announced as a hit or as encoded (and then its
        claim-checked inputs deleted)."""
        if found.kind is Found.CANCELLED:
            self.skipped_cancelled += 1
            await self.report(
                ev.request_id,
                "cancelled",
                error=ErrorInfo(
                    "cancelled",
                    "cancelled: skipped before encoding",
                    modality=ev.modality,
                    item=ev.item_index,
                ),
                info={f"encode.cancelled.{ev.modality}{ev.item_index}": "skipped"},
            )
            return
        if found.kind is Found.HIT:
            self.cache_hits += 1
            self.metrics.items.labels("hit").inc()
            announce = self._encoded(ev, dtype_name(self.bundle.dtype), [], hit=True, ms=0.0)
        else:
            assert found.outputs is not None
            emb = found.outputs[EMBEDS]
            announce = self._encoded(
                ev, dtype_name(emb.dtype), list(emb.shape), hit=False, ms=found.ms, hop_ms=hop_ms
            )
        # Only now (the embedding is stored) is the claim-checked input garbage: a redelivery of
        # this event finds the embedding (a hit) and never reads the claim again.
        await asyncio.gather(announce, self.inputs.drop_claims(ev))

    async def _report_expired(self, ev: EncodeEvent) -> None:
        await self.report(
            ev.request_id,
            "expired",
            error=ErrorInfo(
                "expired",
                "deadline passed before encoding",
                modality=ev.modality,
                item=ev.item_index,
            ),
        )


class Found(enum.Enum):
    """What looking an item up (and encoding it on a miss) came to."""

    HIT = "hit"
    """Its embedding was in the store already (or another event here just stored it)."""
    ENCODED = "encoded"
    """The vision tower ran on it."""
    CANCELLED = "cancelled"
    """Its request was cancelled: nothing read, nothing encoded."""


@dataclass(slots=True)
class Lookup:
    """:meth:`EncodeWorker._lookup_or_encode`'s answer; the outputs when it encoded."""

    kind: Found
    outputs: EncoderOutput | None = None
    t0: float = 0.0
    ms: float = 0.0


async def _discard(task: asyncio.Future[Any]) -> None:
    """Cancel a read started ahead of its need and drop its outcome, whatever it was."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
