"""Prefill worker: PrefillEvents -> wait for embeddings -> splice -> prefill + greedy decode.

Validation is strict (a metadata-only item without a valid ``ec_transfer_params`` entry is
rejected before anything runs), and so are the bounds of what runs (:func:`check_bounds`:
``max_tokens``, prompt length against the context, token ids against the vocabulary, greedy
sampling only). Waiting for embeddings is an async store wait, so one slow request never blocks
others; model compute runs on a single worker thread and stops at the deadline between decode
steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_workers.compute import (
    DeadlineExceeded,
    DecodeStopped,
    EncoderOutput,
    Prefilled,
    context_length,
    greedy_decode,
    prefill,
    vocab_size,
)
from gpu_workers.entries import (
    fetch_outputs,
    items_from_features,
    request_cancelled,
    worker_validation,
)
from runtime.kafka import RequestUpdates, ResultReporter, StatusWriter
from runtime.settings import Settings
from runtime.stores.base import StoreError, StoreTimeout, StoreUnavailable
from runtime.tracing import broker_hop_ms
from schemas.errors import ValidationError
from schemas.status_record import short_hash
from schemas.topics import Topics
from schemas.types import ErrorInfo, PrefillEvent, now_ms
from schemas.validator import validate_prefill_event, validate_prefill_expiry

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.publisher import Publisher
    from runtime.status import CancelWatch, RequestState, RequestStateReader
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one prefill worker agrees to run."""

    vocab_size: int
    context: int
    """Most tokens (prompt + generated) one request may hold."""
    max_tokens: int

    @classmethod
    def for_model(cls, settings: Settings, bundle: ModelBundle) -> Bounds:
        """The settings' caps, held to the model's vocabulary and context."""
        ctx = context_length(bundle)
        if settings.max_context_tokens:
            ctx = min(ctx, settings.max_context_tokens)
        return cls(vocab_size(bundle), ctx, settings.max_tokens_limit)


def check_bounds(ev: PrefillEvent, bounds: Bounds) -> None:
    """Refuse a request the worker must not run, before any tensor is built.

    Rules: ``max-tokens`` (1 .. ``EPD_MAX_TOKENS_LIMIT``), ``context-length`` (prompt +
    ``max_tokens`` within the context), ``token-ids`` (every id below the vocabulary size: on
    CUDA an out-of-range id is a device-side assert that kills the process), ``temperature``
    (only greedy decoding runs, so any other temperature is refused rather than ignored).
    """
    s = ev.sampling
    if not 1 <= s.max_tokens <= bounds.max_tokens:
        raise ValidationError(
            "max-tokens",
            f"max_tokens is {s.max_tokens}; it must be between 1 and {bounds.max_tokens}",
            field="max_tokens",
        )
    if len(ev.token_ids) + s.max_tokens > bounds.context:
        raise ValidationError(
            "context-length",
            f"{len(ev.token_ids)} prompt tokens + max_tokens {s.max_tokens} exceed the context "
            f"of {bounds.context} tokens",
            field="token_ids",
        )
    for i, t in enumerate(ev.token_ids):
        if not 0 <= t < bounds.vocab_size:
            raise ValidationError(
                "token-ids",
                f"token_ids[{i}] = {t} is outside the vocabulary [0, {bounds.vocab_size})",
                field="token_ids",
            )
    if not math.isfinite(s.temperature) or s.temperature != 0.0:
        raise ValidationError(
            "temperature",
            f"temperature is {s.temperature}; this worker decodes greedily, so only 0 is "
            "accepted (sampling is not implemented, and ignoring it would be silent)",
            field="temperature",
        )


def embeddings_lost(missing: list[str], state: RequestState | None, created_ms: int) -> list[str]:
    """Of the ``missing`` item hashes, those whose embedding cannot come any more.

    An item the record says was encoded (or a cache hit) and is no longer in the store is lost
    (Redis evicted it, or the store restarted empty while the records survived). A request
    created before the Redis holding the records last started, whose record holds nothing from
    before that start, lost its record in a restart: everything of it kept in that Redis
    (embeddings, claim-checked inputs) is gone too, so each missing item is lost. ``state``
    None (Redis unreadable) decides nothing.
    """
    if state is None:
        return []
    since = state.records_since_ms
    if state.wiped and since is not None and created_ms < since:
        return list(missing)
    return [h for h in missing if short_hash(h) in state.encoded]


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
        cancel: CancelWatch | None = None,
        request_state: RequestStateReader | None = None,
        record: StatusWriter | None = None,
    ) -> None:
        """``cancel``: asked before the embedding wait, before compute and between decode
        steps; a cancelled request is reported ``cancelled`` and its work is skipped.

        ``request_state``: reads the request's status record. A request whose record is
        already terminal (a redelivered event) is skipped without a word; and when an embedding
        is missing, it tells a lost one (reported ``failed``, ``embedding-lost``) from one still
        coming (waited for).

        ``record`` (``StatusStore.apply``): every update is also written to the request's
        status record directly (the results topic stays the durable record)."""
        self.settings = settings
        self.bundle = bundle
        self.store = store
        self.publisher = publisher
        self.topics = topics or Topics(settings.topic_prefix)
        self.worker_id = worker_id or f"prefill@{socket.gethostname()}"
        self.vconfig = worker_validation(settings, bundle)
        # Every event is checked on arrival without its entries' expiry, which is judged
        # (validate_prefill_expiry) only once the request is known to run: arriving late is no
        # offence for a redelivery of a finished request (nothing runs), and a late one expires.
        self._arrival_vconfig = dataclasses.replace(self.vconfig, now_ms=None)
        self.bounds = Bounds.for_model(settings, bundle)
        self.report = ResultReporter(
            publisher, self.topics.results, "prefill", self.worker_id, record=record
        )
        self.embedding_wait_s = (
            settings.embedding_wait_s if embedding_wait_s is None else embedding_wait_s
        )
        self.cancel = cancel
        self.request_state = request_state
        # One compute thread: the model is shared, and CPU/GPU work does not speed up by
        # interleaving requests inside one process.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="epd-prefill")
        self.completed = 0
        self.cancelled = 0
        self.skipped = 0
        self.lost = 0

    async def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def handle(self, ev: PrefillEvent) -> None:
        """Run one request to completion (or to a clear failure)."""
        updates = RequestUpdates(self.report, ev.request_id)
        try:
            await self._run(ev, updates)
        except BaseException:
            await updates.abandon()
            raise
        await updates.flush()

    async def _run(self, ev: PrefillEvent, updates: RequestUpdates) -> None:
        started = now_ms()
        t_start = time.perf_counter()
        hop_ms = broker_hop_ms(started)
        # Every rule but the entries' expiry is judged on arrival. An unsafe event is still
        # refused (to the DLQ) only after the request's state and deadline are known, as
        # below, but none of its keys is read.
        unsafe: ValidationError | None = None
        try:
            validate_prefill_event(ev, self._arrival_vconfig)
        except ValidationError as exc:
            unsafe = exc
        hashes = dict.fromkeys(h for _, _, h in ev.features.items())
        keys = {} if unsafe else {h: ev.ec_transfer_params[h].key for h in hashes}
        key_list = list(keys.values())
        fetch = unsafe is None and not (ev.deadline_ms is not None and started >= ev.deadline_ms)
        # Three independent reads, one round trip: the record (a redelivery of a finished
        # request?), the cancel flag, and the embeddings, which are often all there (a cache
        # hit, or encoded while this event travelled). Each entry holds all of an item's encoder
        # outputs (embedding, deepstack features).
        record, cancelled, present = await asyncio.gather(
            self.request_state(ev.request_id) if self.request_state else _none(),
            request_cancelled(self.cancel, ev.request_id),
            self._fetch_present(key_list) if fetch else _none(),
        )
        if record is not None and record.terminal:
            # A redelivery (crash before the offset commit, rebalance): the outcome is out
            # already, and a second terminal event would only be folded away downstream. An
            # unsafe event is still refused, whatever state its request is in.
            if unsafe is not None:
                raise unsafe
            self.skipped += 1
            log.info("%s: %s is already %s; skipped", self.worker_id, ev.request_id, record.status)
            return
        # The deadline comes first (judged now, after the reads): the fan-out caps ec_transfer
        # expiry at the deadline, so a late event would otherwise fail validation as ec-expired
        # (rejected) instead of expiring. Nothing is run on this path.
        if ev.deadline_ms is not None and now_ms() >= ev.deadline_ms:
            await updates.now(
                "expired", error=ErrorInfo("expired", "deadline passed before prefill")
            )
            return
        if unsafe is not None:
            raise unsafe
        validate_prefill_expiry(ev, self.vconfig)
        check_bounds(ev, self.bounds)
        if cancelled:
            await self._report_cancelled(updates, "skipped before prefill")
            return
        # Progress updates go out in the background: the request does not wait for the
        # broker's acknowledgement or the record write before its own work.
        updates.soon("prefilling")
        timeout = self.embedding_wait_s
        if ev.deadline_ms is not None:
            timeout = max(0.0, min(timeout, (ev.deadline_ms - now_ms()) / 1000))
        t_wait = time.perf_counter()
        admission_ms = (t_wait - t_start) * 1000
        if present is not None:
            outputs = present
        else:
            ready = await self._ready(ev, keys, updates)
            if ready is None:
                return  # lost: reported
            if not ready:
                try:
                    if not await self._wait_unless_cancelled(key_list, timeout, ev.request_id):
                        # The encoder skips a cancelled request's items: nothing will come.
                        await self._report_cancelled(updates, "skipped before compute")
                        return
                except StoreUnavailable:
                    # Redis went away under the wait. If it came back without the embeddings,
                    # say so now rather than after a retry's full wait; else the loop retries.
                    if await self._ready(ev, keys, updates) is None:
                        return
                    raise
                except StoreTimeout as exc:
                    await self._report_missing(ev, keys, set(exc.missing), timeout, updates)
                    return
            outputs, cancelled = await asyncio.gather(
                fetch_outputs(self.store, key_list, self.bundle.family),
                request_cancelled(self.cancel, ev.request_id),
            )
            if cancelled:
                await self._report_cancelled(updates, "skipped before compute")
                return
        wait_ms = (time.perf_counter() - t_wait) * 1000
        items = items_from_features(ev.features, dict(zip(keys, outputs, strict=True)))
        t_compute = time.perf_counter()
        loop = asyncio.get_running_loop()
        cancel = self.cancel
        rid = ev.request_id
        # Asked in the compute thread, before prefill and between decode steps: a set lookup.
        should_stop = (lambda: cancel.cancelled_now(rid)) if cancel else None

        def run_prefill() -> Prefilled:
            if should_stop is not None and should_stop():
                raise DecodeStopped([])  # cancelled while it waited for the compute thread
            if ev.deadline_ms is not None and now_ms() >= ev.deadline_ms:
                raise DeadlineExceeded([])
            return prefill(self.bundle, ev.token_ids, items)

        try:
            state = await loop.run_in_executor(self._executor, run_prefill)
            # Started from the loop between the two compute calls, so it goes out while the
            # thread decodes (a thread decoding thousands of steps would otherwise hold it up).
            updates.soon("decoding")
            tokens = await loop.run_in_executor(
                self._executor,
                lambda: greedy_decode(
                    self.bundle,
                    state,
                    ev.sampling.max_tokens,
                    stop_token_ids=ev.sampling.stop_token_ids,
                    ignore_eos=ev.sampling.ignore_eos,
                    deadline_ms=ev.deadline_ms,
                    should_stop=should_stop,
                ),
            )
        except DecodeStopped as stopped:
            await self._report_cancelled(updates, f"stopped after {len(stopped.tokens)} tokens")
            return
        except DeadlineExceeded as exc:
            await updates.now(
                "expired",
                token_ids=exc.tokens,
                error=ErrorInfo("expired", f"deadline passed during prefill/decode: {exc}"),
            )
            return
        compute_ms = (time.perf_counter() - t_compute) * 1000
        text = str(self.bundle.tokenizer.decode(tokens, skip_special_tokens=True))
        self.completed += 1
        await updates.now(
            "completed",
            token_ids=tokens,
            text=text,
            timings={
                "queue": float(started - ev.created_ms),
                **({"broker_hop": hop_ms} if hop_ms is not None else {}),
                "admission": admission_ms,
                "embedding_wait": wait_ms,
                "prefill_decode": compute_ms,
                "total": float(now_ms() - ev.created_ms),
            },
        )

    async def _wait_unless_cancelled(
        self, keys: list[str], timeout_s: float, request_id: str
    ) -> bool:
        """The store wait for ``keys``, raced against a cancel of the request: True once they
        are all there, False when the request was cancelled first (StoreTimeout as ever)."""
        if self.cancel is None:
            await self.store.wait(keys, timeout_s)
            return True
        arrived = asyncio.ensure_future(self.store.wait(keys, timeout_s))
        cancelled = asyncio.ensure_future(self.cancel.wait(request_id))
        try:
            await asyncio.wait({arrived, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (arrived, cancelled):
                task.cancel()
            await asyncio.gather(arrived, cancelled, return_exceptions=True)
        if arrived.cancelled():
            return False  # the cancel came first
        arrived.result()  # StoreTimeout / StoreUnavailable raise here
        return True

    async def _fetch_present(self, keys: list[str]) -> list[EncoderOutput] | None:
        """Every entry of ``keys`` if all are in the store now (one read), else None.

        A read ahead of the request's checks: it fails quietly (None), so a store error never
        decides ahead of them; the wait and the read after it surface it."""
        try:
            return await fetch_outputs(self.store, keys, self.bundle.family)
        except StoreError:
            return None

    async def _report_missing(
        self,
        ev: PrefillEvent,
        keys: dict[str, str],
        missing_keys: set[str],
        waited_s: float,
        updates: RequestUpdates,
    ) -> None:
        """The wait ran out: ``failed`` (``expired`` past the deadline), naming the first
        missing item (modality and index), as every rejection does."""
        missing = [h for h, k in keys.items() if k in missing_keys]
        modality, index = next(
            ((m, i) for m, i, h in ev.features.items() if keys[h] in missing_keys),
            (None, None),
        )
        await updates.now(
            "failed" if ev.deadline_ms is None or now_ms() < ev.deadline_ms else "expired",
            error=ErrorInfo(
                "embeddings-missing",
                f"embeddings for {len(missing)} item(s) not in the store after {waited_s:.1f}s: "
                + ", ".join(h[:16] for h in missing),
                modality=modality,
                item=index,
            ),
        )

    async def _ready(
        self, ev: PrefillEvent, keys: dict[str, str], updates: RequestUpdates
    ) -> bool | None:
        """Whether every embedding is in the store already (True: nothing to wait for), or
        may still come (False: wait for it, also when the store cannot tell); None when one
        cannot come any more, which is reported (``failed``, ``embedding-lost``). The record is
        read only when something is missing."""
        try:
            present = await asyncio.gather(*(self.store.exists(k) for k in keys.values()))
        except StoreUnavailable:
            return False  # cannot tell; the wait (or its retry) decides
        missing = [h for h, ok in zip(keys, present, strict=True) if not ok]
        if not missing:
            return True
        if self.request_state is None:
            return False
        state = await self.request_state(ev.request_id, since=True)
        lost = embeddings_lost(missing, state, ev.created_ms)
        if lost:
            # The record was read after the EXISTS above: an item stored and marked encoded in
            # between reads "encoded" while its key was missing then. Only a key still missing
            # now, after the record said encoded, is gone.
            try:
                again = await asyncio.gather(*(self.store.exists(keys[h]) for h in lost))
            except StoreUnavailable:
                return False
            lost = [h for h, ok in zip(lost, again, strict=True) if not ok]
        if not lost:
            return False
        modality, index = next(
            ((m, i) for m, i, h in ev.features.items() if h in lost), (None, None)
        )
        self.lost += 1
        await updates.now(
            "failed",
            error=ErrorInfo(
                "embedding-lost",
                f"embeddings for {len(lost)} item(s) are gone from the store and cannot arrive "
                "any more (evicted after they were stored, or lost with a Redis restart): "
                + ", ".join(h[:16] for h in lost),
                modality=modality,
                item=index,
            ),
        )
        return None

    async def _report_cancelled(self, updates: RequestUpdates, what: str) -> None:
        self.cancelled += 1
        await updates.now(
            "cancelled",
            error=ErrorInfo("cancelled", f"cancelled: {what}"),
            # info survives in the record even though the API's cancel was the terminal status
            info={"prefill.cancelled": what},
        )


async def _none() -> None:
    """An awaitable None (a read this worker was not given)."""
    return None
