"""Prefill worker: PrefillEvents -> wait for embeddings -> splice -> prefill + greedy decode.

Validation is strict (a metadata-only item without a valid ``ec_transfer_params`` entry is
rejected before anything runs). Waiting for embeddings is an async store wait, so one slow
request never blocks others; model compute runs on a single worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from gpu_workers.compute import DecodeStopped, ItemEmbedding, Prefilled, greedy_decode, prefill
from runtime.kafka import ResultReporter
from runtime.settings import Settings
from runtime.stores.base import StoreTimeout
from schemas.errors import ValidationError
from schemas.topics import Topics
from schemas.types import ErrorInfo, PrefillEvent, now_ms
from schemas.validator import ValidationConfig, validate_prefill_event

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

    from runtime.model import ModelBundle
    from runtime.status_store import CancelWatch
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)

GRID_FIELD = {"image": "image_grid_thw", "video": "video_grid_thw"}


class PrefillWorker:
    """Handles PrefillEvents; plug :meth:`handle` into a ConsumeLoop."""

    def __init__(
        self,
        settings: Settings,
        bundle: ModelBundle,
        store: EmbeddingStore,
        producer: AIOKafkaProducer,
        *,
        topics: Topics | None = None,
        worker_id: str | None = None,
        embedding_wait_s: float = 60.0,
        cancel: CancelWatch | None = None,
    ) -> None:
        """``cancel``: asked before the embedding wait, before compute and between decode
        steps; a cancelled request is reported ``cancelled`` and its work is skipped."""
        self.settings = settings
        self.bundle = bundle
        self.store = store
        self.producer = producer
        self.topics = topics or Topics(settings.topic_prefix)
        self.worker_id = worker_id or f"prefill@{socket.gethostname()}"
        self.vconfig = ValidationConfig.for_worker(settings, bundle.fingerprint)
        self.report = ResultReporter(producer, self.topics.results, "prefill", self.worker_id)
        self.embedding_wait_s = embedding_wait_s
        self.cancel = cancel
        # One compute thread: the model is shared, and CPU/GPU work does not speed up by
        # interleaving requests inside one process.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="epd-prefill")
        self.completed = 0
        self.cancelled = 0

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _items(self, ev: PrefillEvent, embeds: dict[str, object]) -> list[ItemEmbedding]:
        items = []
        meta = ev.features.mm_metadata or {}
        for modality, index, mm_hash in ev.features.items():
            ph = ev.features.mm_placeholders[modality][index]
            grid_field = GRID_FIELD.get(modality)
            item_meta = meta.get(modality, [None] * (index + 1))[index] or {}
            grid = item_meta.get(grid_field) if grid_field else None
            if grid is None:
                raise ValidationError(
                    "metadata-missing",
                    f"{grid_field or 'grid'} is needed for M-RoPE positions",
                    modality=modality,
                    item=index,
                )
            items.append(
                ItemEmbedding(
                    modality=modality,
                    offset=ph.offset,
                    length=ph.length,
                    embeds=embeds[mm_hash],  # type: ignore[arg-type]
                    grid_thw=grid,  # type: ignore[arg-type]
                )
            )
        items.sort(key=lambda it: it.offset)
        return items

    async def handle(self, ev: PrefillEvent) -> None:
        """Run one request to completion (or to a clear failure)."""
        started = now_ms()
        # The deadline comes first: the fan-out caps ec_transfer expiry at the deadline, so a late
        # event would otherwise fail validation as ec-expired (rejected) instead of expiring.
        # Nothing is read or run on this path.
        if ev.deadline_ms is not None and started >= ev.deadline_ms:
            await self.report(
                ev.request_id,
                "expired",
                error=ErrorInfo("expired", "deadline passed before prefill"),
            )
            return
        validate_prefill_event(ev, self.vconfig)
        if await self._cancelled(ev.request_id, "before prefill"):
            return
        await self.report(ev.request_id, "prefilling")
        hashes = dict.fromkeys(h for _, _, h in ev.features.items())
        keys = {h: ev.ec_transfer_params[h].key for h in hashes}
        timeout = self.embedding_wait_s
        if ev.deadline_ms is not None:
            timeout = max(0.0, min(timeout, (ev.deadline_ms - now_ms()) / 1000))
        t_wait = time.perf_counter()
        try:
            await self.store.wait(list(keys.values()), timeout)
        except StoreTimeout as exc:
            missing_keys = set(exc.missing)
            missing = [h for h, k in keys.items() if k in missing_keys]
            # Name the first missing item (modality and index), as every other rejection does.
            modality, index = next(
                ((m, i) for m, i, h in ev.features.items() if keys[h] in missing_keys),
                (None, None),
            )
            await self.report(
                ev.request_id,
                "failed" if ev.deadline_ms is None or now_ms() < ev.deadline_ms else "expired",
                error=ErrorInfo(
                    "embeddings-missing",
                    f"embeddings for {len(missing)} item(s) not in the store after {timeout:.1f}s: "
                    + ", ".join(h[:16] for h in missing),
                    modality=modality,
                    item=index,
                ),
            )
            return
        tensors = await self.store.get_many(list(keys.values()))
        wait_ms = (time.perf_counter() - t_wait) * 1000
        items = self._items(ev, dict(zip(keys, tensors, strict=True)))
        if await self._cancelled(ev.request_id, "before compute"):
            return
        t_compute = time.perf_counter()
        loop = asyncio.get_running_loop()
        cancel = self.cancel
        rid = ev.request_id
        # Asked in the compute thread, before prefill and between decode steps: a set lookup.
        should_stop = (lambda: cancel.cancelled_now(rid)) if cancel else None

        def run_prefill() -> Prefilled:
            if should_stop is not None and should_stop():
                raise DecodeStopped([])  # cancelled while it waited for the compute thread
            return prefill(self.bundle, ev.token_ids, items)

        try:
            state = await loop.run_in_executor(self._executor, run_prefill)
            # Reported from the loop between the two compute calls, so the update is out before
            # decoding starts (a thread decoding thousands of steps would hold it up).
            await self.report(rid, "decoding")
            tokens = await loop.run_in_executor(
                self._executor,
                lambda: greedy_decode(
                    self.bundle,
                    state,
                    ev.sampling.max_tokens,
                    stop_token_ids=ev.sampling.stop_token_ids,
                    ignore_eos=ev.sampling.ignore_eos,
                    should_stop=should_stop,
                ),
            )
        except DecodeStopped as stopped:
            await self._report_cancelled(rid, f"stopped after {len(stopped.tokens)} tokens")
            return
        compute_ms = (time.perf_counter() - t_compute) * 1000
        text = str(self.bundle.tokenizer.decode(tokens, skip_special_tokens=True))
        self.completed += 1
        await self.report(
            ev.request_id,
            "completed",
            token_ids=tokens,
            text=text,
            timings={
                "queue": float(started - ev.created_ms),
                "embedding_wait": wait_ms,
                "prefill_decode": compute_ms,
                "total": float(now_ms() - ev.created_ms),
            },
        )

    async def _cancelled(self, request_id: str, where: str) -> bool:
        """True (and reported) when the request was cancelled: its work is skipped."""
        if self.cancel is None or not await self.cancel.is_cancelled(request_id):
            return False
        await self._report_cancelled(request_id, f"skipped {where}")
        return True

    async def _report_cancelled(self, request_id: str, what: str) -> None:
        self.cancelled += 1
        await self.report(
            request_id,
            "cancelled",
            error=ErrorInfo("cancelled", f"cancelled: {what}"),
            # info survives in the record even though the API's cancel was the terminal status
            info={"prefill.cancelled": what},
        )
