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

from gpu_workers.compute import generate_from_embeddings
from gpu_workers.entries import fetch_outputs, items_from_features, worker_validation
from runtime.kafka import ResultReporter
from runtime.settings import Settings
from runtime.stores.base import StoreTimeout
from schemas.topics import Topics
from schemas.types import ErrorInfo, PrefillEvent, now_ms
from schemas.validator import validate_prefill_event

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.publisher import Publisher
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)


class PrefillWorker:
    """Handles PrefillEvents; plug :meth:`handle` into a ConsumeLoop."""

    def __init__(
        self,
        settings: Settings,
        bundle: ModelBundle,
        store: EmbeddingStore,
        publisher: Publisher,
        *,
        topics: Topics | None = None,
        worker_id: str | None = None,
        embedding_wait_s: float | None = None,
    ) -> None:
        self.settings = settings
        self.bundle = bundle
        self.store = store
        self.publisher = publisher
        self.topics = topics or Topics(settings.topic_prefix)
        self.worker_id = worker_id or f"prefill@{socket.gethostname()}"
        self.vconfig = worker_validation(settings, bundle)
        self.report = ResultReporter(publisher, self.topics.results, "prefill", self.worker_id)
        self.embedding_wait_s = (
            settings.embedding_wait_s if embedding_wait_s is None else embedding_wait_s
        )
        # One compute thread: the model is shared, and CPU/GPU work does not speed up by
        # interleaving requests inside one process.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="epd-prefill")
        self.completed = 0

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

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
        # Each entry holds all of an item's encoder outputs (embedding, deepstack features).
        outputs = await fetch_outputs(self.store, list(keys.values()), self.bundle.family)
        wait_ms = (time.perf_counter() - t_wait) * 1000
        items = items_from_features(ev.features, dict(zip(keys, outputs, strict=True)))
        t_compute = time.perf_counter()
        tokens = await asyncio.get_running_loop().run_in_executor(
            self._executor,
            lambda: generate_from_embeddings(
                self.bundle,
                ev.token_ids,
                items,
                ev.sampling.max_tokens,
                stop_token_ids=ev.sampling.stop_token_ids,
                ignore_eos=ev.sampling.ignore_eos,
            ),
        )
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
