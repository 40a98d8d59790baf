"""Encode worker: EncodeEvents -> vision tower (micro-batched) -> embedding store -> EncodedEvent.

A store hit, or the same mm_hash already being encoded by this worker, never runs the encoder
a second time. Encode events are keyed by mm_hash, so repeats of one image land on one
partition, hence on one worker, where its single flight (:mod:`gpu_workers.single_flight`) sees
them.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import blake3
import torch

from gpu_workers.batcher import MicroBatcher
from gpu_workers.compute import EncoderOutput, encode_items
from gpu_workers.entries import request_cancelled, store_outputs, worker_validation
from gpu_workers.metrics import encode_metrics
from gpu_workers.single_flight import SingleFlight
from runtime.model import vision_config
from runtime.publisher import publish
from runtime.reporting import ResultReporter, StatusWriter
from runtime.settings import Settings
from runtime.stores.base import StoreError, StoreKeyMissing
from runtime.tracing import broker_hop_ms
from schemas.errors import ValidationError
from schemas.families import EMBEDS
from schemas.keys import claim_key
from schemas.modalities import GRID_FIELDS, MAIN_ENCODER_INPUT
from schemas.status_record import encoded_update
from schemas.tensors import dtype_name, tensor_from_bytes
from schemas.topics import Topics
from schemas.types import EncodedEvent, EncodeEvent, ErrorInfo, TensorRef, now_ms
from schemas.validator import check_tensor, validate_encode_event
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from runtime.model import ModelBundle
    from runtime.publisher import Publisher
    from runtime.status import CancelWatch
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)

Job = tuple[torch.Tensor, torch.Tensor]


class InputLost(Exception):
    """A claim-checked input that is not in the store any more: retrying cannot bring it
    back, and it was valid when it was sent (``failed``/``input-lost``, never ``rejected``)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


class EncodeWorker:
    """Handles EncodeEvents; plug :meth:`handle` into a ConsumeLoop."""

    def __init__(
        self,
        settings: Settings,
        bundle: ModelBundle,
        store: EmbeddingStore,
        publisher: Publisher,
        *,
        topics: Topics | None = None,
        worker_id: str | None = None,
        cancel: CancelWatch | None = None,
        registry: CollectorRegistry | None = None,
        record: StatusWriter | None = None,
    ) -> None:
        """``cancel``: asked (beside the store lookup) before any input is read or encoded; a
        cancelled request's item is skipped and reported ``cancelled``. The event is validated
        first, so an unsafe one goes to the DLQ whatever its request's state.

        ``record`` (``StatusStore.apply``): each item's encoded (or cached) mark, and every
        status update, is also written to the request's status record directly, so the
        request's outcome never shows up before its items' encode timings."""
        self.settings = settings
        self.bundle = bundle
        self.store = store
        self.publisher = publisher
        self.topics = topics or Topics(settings.topic_prefix)
        self.worker_id = worker_id or f"encode@{socket.gethostname()}"
        self.vconfig = worker_validation(settings, bundle, store)
        self.report = ResultReporter(
            publisher, self.topics.results, "encode", self.worker_id, record=record
        )
        self.batcher: MicroBatcher[Job, EncoderOutput] = MicroBatcher(
            self._compute, max_cost=settings.encode_batch_patches
        )
        self.flights: SingleFlight[str] = SingleFlight()
        """Items being encoded now, by store key: a second event of one waits for the first."""
        self.cache_hits = 0
        self.items_encoded = 0
        self.claims_deleted = 0
        self.cancel = cancel
        self.metrics = encode_metrics(registry)  # the worker's /metrics (None: private series)
        self.skipped_cancelled = 0

    @property
    def encoder_calls(self) -> int:
        """Vision-tower calls made so far (one per micro-batch)."""
        return self.batcher.batches

    def _compute(self, jobs: Sequence[Job]) -> list[EncoderOutput]:
        return encode_items(self.bundle, jobs)

    async def close(self) -> None:
        await self.batcher.close()

    async def _tensor(
        self, value: torch.Tensor | TensorRef, name: str, ev: EncodeEvent
    ) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if value.store != self.store.url:
            raise ValidationError(
                "claim-check",
                f"TensorRef points at store {value.store!r}, this worker reads {self.store.url!r}",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
        if not value.key.startswith(f"{self.settings.ec_namespace}:"):
            raise ValidationError(
                "ec-namespace",
                f"claim-check key {value.key!r} is outside namespace "
                f"{self.settings.ec_namespace!r}",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
        try:
            raw = await self.store.get_bytes(value.key)
            self.metrics.bytes_in.inc(len(raw))
        except StoreKeyMissing:
            # The fan-out stores the input before it sends the event: missing means it expired
            # while queued or was lost with the store. Ours to report, not the request's fault.
            raise InputLost(
                ErrorInfo(
                    "input-lost",
                    f"claim-checked input {value.key!r} is gone from the store (expired while "
                    "queued, or lost with a store restart); resubmit the request",
                    rule="claim-check",
                    modality=ev.modality,
                    item=ev.item_index,
                    field=name,
                )
            ) from None
        # Hashing and scanning megabytes takes milliseconds: keep it off the event loop.
        return await asyncio.to_thread(self._verified, value, raw, name, ev)

    async def _inputs(
        self, ev: EncodeEvent, pv_name: str, grid_name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The item's pixels and grid, read from the store where claim-checked, and checked."""
        pixels = await self._tensor(ev.data[pv_name], pv_name, ev)
        grid = await self._tensor(ev.data[grid_name], grid_name, ev)
        return pixels, grid

    def _verified(self, ref: TensorRef, raw: bytes, name: str, ev: EncodeEvent) -> torch.Tensor:
        if blake3.blake3(raw).hexdigest() != ref.digest:
            raise ValidationError(
                "claim-check",
                f"digest mismatch for {ref.key!r}",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
        tensor = tensor_from_bytes(ref.dtype, ref.shape, raw)
        # The event only carried the reference: check the values now that we hold them.
        check_tensor(tensor, self.vconfig, modality=ev.modality, item=ev.item_index, name=name)
        return tensor

    async def _drop_claims(self, ev: EncodeEvent) -> None:
        """Delete this item's claim-checked inputs (megabytes each) once its embedding is stored.

        Only keys the fan-out would have written for this item (:func:`claim_key`) in this
        worker's store are deleted, so an event cannot name another key for deletion. A failed
        delete is logged, not raised: the claim's own TTL removes it anyway.
        """
        for name, value in ev.data.items():
            if not isinstance(value, TensorRef) or value.store != self.store.url:
                continue
            # The signed entry's key ends with the fan-out's own hash, which the claims use too
            # (it equals mm_hash except for a vLLM render's foreign label).
            key_hash = ev.ec_transfer.key.rpartition(":")[2]
            if value.key != claim_key(self.settings.ec_namespace, key_hash, name):
                continue
            try:
                await self.store.delete(value.key)
                self.claims_deleted += 1
            except StoreError as exc:
                log.warning("%s: could not delete claim %s (%r)", self.worker_id, value.key, exc)

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
        # record writer), and through the results collector, which reads the topic.
        await asyncio.gather(
            self.report.write_through(encoded_update(encoded, hop_ms=hop_ms)),
            publish(self.publisher, self.topics, encoded),
        )

    def _fields(self, ev: EncodeEvent) -> tuple[str, str]:
        pv_name = MAIN_ENCODER_INPUT.get(ev.modality)
        grid_name = GRID_FIELDS.get(ev.modality)
        if pv_name is None or grid_name is None or ev.modality not in self.bundle.family.modalities:
            raise ValidationError(
                "encode-inputs",
                f"modality {ev.modality!r} has no vision encoder here; supported: "
                f"{sorted(MAIN_ENCODER_INPUT)}",
                modality=ev.modality,
                item=ev.item_index,
            )
        return pv_name, grid_name

    def _check_patch_width(self, pixels: torch.Tensor, name: str, ev: EncodeEvent) -> None:
        # Rows were checked against the grid; the width is the model's. A wrong width would
        # fail torch.cat for every item of the micro-batch, not just this one.
        vc = vision_config(self.bundle.config)
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
        if pixels.ndim != 2 or pixels.shape[1] != width:
            raise ValidationError(
                "encode-inputs",
                f"{name} has shape {list(pixels.shape)}; this model takes (patches, {width})",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
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
        pv_name, grid_name = self._fields(ev)
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
        inputs = asyncio.ensure_future(self._inputs(ev, pv_name, grid_name))
        t0 = time.perf_counter()
        # A batch being formed waits for this item while its inputs arrive (a hit or a cancel
        # withdraws it on leaving the block).
        with self.batcher.on_the_way():
            try:
                cancelled, hit = await asyncio.gather(
                    request_cancelled(self.cancel, ev.request_id),
                    self.store.touch(ev.ec_transfer.key, self.settings.embedding_ttl_s),
                )
            except BaseException:
                await _discard(inputs)
                raise
            if cancelled or hit:
                await _discard(inputs)
                return Lookup(Found.CANCELLED if cancelled else Found.HIT)
            pixels, grid = await inputs
            self._check_patch_width(pixels, pv_name, ev)
            out = await self.batcher.submit((pixels, grid), cost=int(pixels.shape[0]))
        return Lookup(Found.ENCODED, out, t0)

    async def _store(self, ev: EncodeEvent, found: Lookup) -> None:
        """Write the item's entry: the embedding and any other outputs (deepstack) together."""
        out = found.outputs
        assert out is not None
        await store_outputs(
            self.store, ev.ec_transfer.key, out, self.bundle.family, self.settings.embedding_ttl_s
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
        await asyncio.gather(announce, self._drop_claims(ev))

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
