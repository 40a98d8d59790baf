"""Decode worker (the optional decode stage): DecodeEvents -> the parked KV cache -> decode.

A prefill worker with ``EPD_DECODE_STAGE=true`` runs a request's prompt, parks its KV cache in
the store and hands the request over (:mod:`gpu_workers.kv_handoff`). A decode worker checks the
event (the decode rules of :mod:`schemas.kv_entries` and every prefill rule), reads the cache
back and decodes in its own batch, exactly as the prefill worker would have (the same engine,
sampling, stop strings, token stream, cancel and deadline), reporting as stage ``decode``.

Taking over: a decode worker that dies mid-generation leaves its event uncommitted; the one
that gets its partition decodes the request again from the parked cache, or, when the cache
has expired or is gone, by running the prefill itself from the embeddings (which the embedded
prefill event still points at). Decoding is deterministic (greedy, or seeded per request), so the
tokens are the same, and the token stream resumes where the dead worker left it. The dead
worker wrote no terminal status, so there is exactly one. Two events of one request on one
worker (a prefill redelivered after it handed off) are one flight: the second finds the request
finished.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_workers.compute import prefill
from gpu_workers.entries import items_from_features
from gpu_workers.kv_handoff import fetch, kv_shape, restore
from gpu_workers.prefill import PrefillWorker
from gpu_workers.single_flight import SingleFlight
from runtime.reporting import RequestUpdates
from runtime.stores.base import StoreError
from schemas.types import DecodeEvent, now_ms
from schemas.validator import validate_decode_event, validate_prefill_expiry

if TYPE_CHECKING:
    from gpu_workers.compute import Prefilled


class DecodeWorker(PrefillWorker):
    """Handles DecodeEvents; plug :meth:`handle` into a ConsumeLoop (group ``{prefix}-decode``)."""

    STAGE = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The prefill worker's arguments (its store holds the parked caches)."""
        super().__init__(*args, **kwargs)
        self.kv_shape = kv_shape(self.bundle)
        self.flights: SingleFlight[str] = SingleFlight()
        self.from_kv = 0
        self.prefilled_again = 0

    async def handle(self, ev: DecodeEvent) -> None:  # type: ignore[override]
        """Decode one handed-over request to its end (or a clear failure)."""
        validate_decode_event(ev, self._arrival_vconfig, self.kv_shape)
        flight = await self.flights.join(ev.request_id)
        if flight is None:
            self.skipped += 1  # another event of this request ran here meanwhile
            return
        with flight:
            updates = RequestUpdates(self.report, ev.request_id)
            try:
                await self._decode(ev, updates)
            except BaseException:
                await updates.abandon()
                raise
            await updates.flush()

    async def _decode(self, dev: DecodeEvent, updates: RequestUpdates) -> None:
        ev = dev.prefill
        handoff_ms = float(max(0, now_ms() - dev.created_ms))
        admitted = await self._admit(ev, updates, reads_embeddings=False)
        if admitted is None:
            return
        t_fetch = time.perf_counter()
        kv = dev.kv
        # A store that cannot answer raises here (the loop retries: the cache may be there).
        live = kv is not None and kv.expires_ms > now_ms()
        tensors = await fetch(self.store, kv) if kv is not None and live else None
        timings: dict[str, float] = {
            "queue": float(admitted.started_ms - ev.created_ms),
            "handoff": handoff_ms,
            "kv_fetch": (time.perf_counter() - t_fetch) * 1000,
        }
        start: Callable[[], Prefilled]
        if kv is not None and tensors is not None:
            start = functools.partial(restore, self.bundle, kv, tensors)
            source = "kv"
            self.from_kv += 1
        else:
            # No cache (expired, evicted, never parked): run the prefill here, from the
            # embeddings the prefill event points at.
            validate_prefill_expiry(ev, self.vconfig)
            outputs = await self._await_embeddings(ev, admitted, updates)
            if outputs is None:
                return
            items = items_from_features(ev.features, dict(zip(admitted.keys, outputs, strict=True)))
            start = functools.partial(prefill, self.bundle, ev.token_ids, items)
            source = "prefill"
            self.prefilled_again += 1
        result = await self._generate(ev, start, updates)
        await self._report(ev, result, timings, updates, {"decode.from": source})
        if kv is not None:
            with contextlib.suppress(StoreError):
                await self.store.delete(kv.key)  # its TTL would; this frees the memory now
