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
from typing import TYPE_CHECKING

from gpu_workers.entries import items_from_features
from gpu_workers.generation import Generator
from gpu_workers.instant import engine_for
from gpu_workers.kv_handoff import fetch, kv_shape, restore
from gpu_workers.lifecycle.parts import RequestLifecycle
from gpu_workers.single_flight import SingleFlight
from runtime.stores.errors import StoreError
from schemas.types import DecodeEvent, now_ms

if TYPE_CHECKING:
    from gpu_workers.compute import Prefilled
    from gpu_workers.context import WorkerContext
    from gpu_workers.lifecycle.admission import Admitted
    from runtime.reporting import RequestUpdates
    from runtime.status import RequestStateReader
    from runtime.token_stream import TokenStreams


class DecodeWorker:
    """Handles DecodeEvents; plug :meth:`handle` into a ConsumeLoop (group ``{prefix}-decode``).

    The prefill worker's sibling: the same lifecycle pieces
    (:class:`~gpu_workers.lifecycle.parts.RequestLifecycle`) and decode batch
    (:class:`~gpu_workers.generation.Generator`), a request admitted as handed over (its
    embeddings read only when the parked cache is gone) and started from its cache.
    """

    STAGE = "decode"

    def __init__(
        self,
        ctx: WorkerContext,
        *,
        embedding_wait_s: float | None = None,
        request_state: RequestStateReader | None = None,
        streams: TokenStreams | None = None,
    ) -> None:
        """The prefill worker's arguments (``ctx.store`` holds the parked caches)."""
        self.ctx = ctx
        self.life = RequestLifecycle.build(
            ctx, self.STAGE, embedding_wait_s=embedding_wait_s, request_state=request_state
        )
        self.worker_id = self.life.worker_id
        self.tally = self.life.tally
        self.engine = engine_for(ctx.settings, ctx.bundle)
        self.generator = Generator(ctx, self.engine, self.life.watch, streams=streams)
        self.kv_shape = kv_shape(ctx.bundle)
        self.flights: SingleFlight[str] = SingleFlight()

    async def close(self) -> None:
        await self.life.close()
        await self.engine.close()

    async def handle(self, ev: DecodeEvent) -> None:
        """Decode one handed-over request to its end (or a clear failure)."""
        self.life.gate.check_handoff(ev, self.kv_shape)
        flight = await self.flights.join(ev.request_id)
        if flight is None:
            self.tally.skipped += 1  # another event of this request ran here meanwhile
            return
        with flight:
            await self.life.run(ev.request_id, lambda updates: self._decode(ev, updates))

    async def _decode(self, dev: DecodeEvent, updates: RequestUpdates) -> None:
        ev = dev.prefill
        handoff_ms = float(max(0, now_ms() - dev.created_ms))
        admitted = await self.life.gate.admit_handed_over(ev, updates)
        if admitted is None:
            return
        t_fetch = time.perf_counter()
        kv = dev.kv
        # A store that cannot answer raises here (the loop retries: the cache may be there).
        live = kv is not None and kv.expires_ms > now_ms()
        tensors = await fetch(self.ctx.store, kv) if kv is not None and live else None
        timings: dict[str, float] = {
            "queue": float(admitted.started_ms - ev.created_ms),
            "handoff": handoff_ms,
            "kv_fetch": (time.perf_counter() - t_fetch) * 1000,
        }
        start: Callable[[], Prefilled] | None
        if kv is not None and tensors is not None:
            start = functools.partial(restore, self.ctx.bundle, kv, tensors)
            source = "kv"
            self.tally.from_kv += 1
        else:
            start = await self._prefill_again(dev, admitted, updates)
            if start is None:
                return
            source = "prefill"
            self.tally.prefilled_again += 1
        result = await self.generator.run(ev, start, updates)
        await self.life.outcomes.finished(ev, result, timings, updates, {"decode.from": source})
        if kv is not None:
            with contextlib.suppress(StoreError):
                await self.ctx.store.delete(kv.key)  # its TTL would; this frees the memory now

    async def _prefill_again(
        self, dev: DecodeEvent, admitted: Admitted, updates: RequestUpdates
    ) -> Callable[[], Prefilled] | None:
        """No cache (expired, evicted, never parked): the prefill to run here, from the
        embeddings the prefill event points at; None when the request ended waiting for them."""
        ev = dev.prefill
        self.life.gate.check_entries_expiry(ev)
        outputs = await self.life.embeddings.collect(ev, admitted, updates)
        if outputs is None:
            return None
        items = items_from_features(ev.features, dict(zip(admitted.keys, outputs, strict=True)))
        return functools.partial(self.engine.prefill, ev.token_ids, items)
