"""Prefill worker: PrefillEvents -> wait for embeddings -> splice -> prefill + decode.

Validation is strict (a metadata-only item without a valid ``ec_transfer_params`` entry is
rejected before anything runs), and so are the bounds of what runs: the door's own
:class:`runtime.request_limits.RequestLimits`, built from the settings and this model's
vocabulary and context (``max_tokens``, sampling parameters, token ids against the vocabulary,
prompt + ``max_tokens`` against the context), so an event written straight to the topic is
refused with the rule and message the door gives. Waiting for embeddings is an async store
wait, so one slow request never blocks others; model compute runs on one compute thread, where
every request the worker holds decodes in one batch (:mod:`gpu_workers.engine`: a forward per
step over all of them, each stopping at its own end, deadline or cancel), tokens streamed as
they come (:mod:`runtime.token_stream`).
With the decode stage on, the worker parks the KV cache and hands the request to a decode
worker (:mod:`gpu_workers.decode`) instead of decoding it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu_workers.compute import (
    EncoderOutput,
    ItemEmbedding,
    Prefilled,
    context_length,
    new_sequence,
    prefill,
    vocab_size,
)
from gpu_workers.engine import CANCELLED, COMPLETED, EXPIRED, DecodeEngine, DecodeJob
from gpu_workers.entries import (
    fetch_outputs,
    items_from_features,
    request_cancelled,
    worker_validation,
)
from gpu_workers.kv_handoff import kv_entry, kv_tensors, park
from runtime.publisher import publish
from runtime.reporting import RequestUpdates, ResultReporter, StatusWriter
from runtime.request_limits import RequestLimits
from runtime.settings import Settings
from runtime.stores.base import StoreError, StoreTimeout, StoreUnavailable
from runtime.tracing import broker_hop_ms
from schemas.errors import ValidationError
from schemas.status_record import HANDOFF_INFO, short_hash
from schemas.topics import Topics
from schemas.types import DecodeEvent, ErrorInfo, PrefillEvent, now_ms
from schemas.validator import validate_prefill_event, validate_prefill_expiry
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.publisher import Publisher
    from runtime.status import CancelWatch, RequestState, RequestStateReader
    from runtime.stores.base import EmbeddingStore
    from runtime.token_stream import TokenStreams, TokenStreamWriter

log = logging.getLogger(__name__)


def worker_limits(settings: Settings, bundle: ModelBundle) -> RequestLimits:
    """The door's :class:`RequestLimits` for this model: the settings, held to what the model
    knows (its vocabulary and context), as the API builds them from the model's render info."""
    return RequestLimits.from_settings(
        settings, vocab_size=vocab_size(bundle), model_context=context_length(bundle)
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


class Readiness(enum.Enum):
    """Where a request's embeddings stand once the first read did not find them all."""

    PRESENT = "present"
    """Every entry is in the store now: read them, nothing to wait for."""
    COMING = "coming"
    """Some are missing but may still arrive (or the store cannot tell): wait for them."""
    LOST = "lost"
    """One can never arrive (evicted after it was stored, or lost with a Redis restart)."""


@dataclass(slots=True)
class Admission:
    """A request let in to run: its store keys and what the first read found."""

    keys: dict[str, str]
    """mm_hash -> its entry's store key, in the request's item order."""
    present: list[EncoderOutput] | None
    """Every entry, when all were in the store at the first read (else None)."""
    started_ms: int
    t_start: float
    hop_ms: float | None

    @property
    def key_list(self) -> list[str]:
        return list(self.keys.values())


GONE_DETAIL = (
    "the request's status record went while it decoded (its TTL, an eviction, an operator); "
    "nobody can read its outcome"
)


@dataclass(slots=True)
class Generation:
    """What the compute phase made of an admitted request."""

    outcome: str
    """``completed``, ``cancelled`` or ``expired``: the status it is reported with."""
    tokens: list[int]
    """Every token generated (for a stopped request, the ones made before it stopped)."""
    detail: str = ""
    compute_ms: float = 0.0
    text: str = ""
    """The tokens' text (cut at a stop string)."""
    finish_reason: str | None = None
    """``stop`` or ``length`` once completed."""
    stream: TokenStreamWriter | None = None
    """The request's token stream, still to be ended."""
    gone: bool = False
    """Stopped because the request's status record went while it decoded (see
    :meth:`PrefillWorker._record_gone`)."""


class PrefillWorker:
    """Handles PrefillEvents; plug :meth:`handle` into a ConsumeLoop.

    One request goes through four phases: :meth:`_admit` (validation, the request's state,
    deadline, bounds and cancel flag, read together with the embeddings in one round trip),
    :meth:`_await_embeddings` (waits for those the first read missed, unless they cannot come
    any more), :meth:`_compute` (prefill, then decode in the worker's batch) and
    :meth:`_report` (the outcome and timings). A phase that ends the request early reports
    why itself and returns None. With the decode stage on (``EPD_DECODE_STAGE``),
    :meth:`_hand_off` replaces the last two: the KV cache is parked and the request handed to
    a decode worker.
    """

    STAGE = "prefill"
    """The stage name on this worker's status updates."""

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
        streams: TokenStreams | None = None,
    ) -> None:
        """``cancel``: asked before the embedding wait, before compute and between decode
        steps; a cancelled request is reported ``cancelled`` (with the tokens made before the
        cancel took effect) and its work is skipped.

        ``request_state``: reads the request's status record. A request whose record is
        already terminal (a redelivered event) is skipped without a word; and when an embedding
        is missing, it tells a lost one (reported ``failed``, ``embedding-lost``) from one still
        coming (waited for).

        ``record`` (``StatusStore.apply``): every update is also written to the request's
        status record directly (the results topic stays the durable record).

        ``streams``: each request's tokens are written to its token stream while it decodes
        (:mod:`runtime.token_stream`), ended before its terminal status."""
        self.settings = settings
        self.bundle = bundle
        self.store = store
        self.publisher = publisher
        self.topics = topics or Topics(settings.topic_prefix)
        self.worker_id = worker_id or f"prefill@{socket.gethostname()}"
        self.vconfig = worker_validation(settings, bundle, store)
        # Every event is checked on arrival without its entries' expiry, which is judged
        # (validate_prefill_expiry) only once the request is known to run: arriving late is no
        # offence for a redelivery of a finished request (nothing runs), and a late one expires.
        self._arrival_vconfig = dataclasses.replace(self.vconfig, now_ms=None)
        self.limits = worker_limits(settings, bundle)
        self.report = ResultReporter(
            publisher,
            self.topics.results,
            self.STAGE,
            self.worker_id,
            record=record,
            on_gone=lambda event: self._record_gone(event.request_id),
        )
        self.embedding_wait_s = (
            settings.embedding_wait_s if embedding_wait_s is None else embedding_wait_s
        )
        self.cancel = cancel
        self.request_state = request_state
        self.streams = streams
        # One compute thread runs the batch: requests decode together, one forward per step.
        self.engine = DecodeEngine.for_settings(settings, bundle)
        self.completed = 0
        self.cancelled = 0
        self.skipped = 0
        self.lost = 0
        self.handed_off = 0
        self.decoding: dict[str, int] = {}
        """Requests in this worker's batch -> their creation time (epoch ms)."""
        self.gone: set[str] = set()
        """Requests in the batch whose status record went: stopped at the next step."""
        self._judging: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for task in list(self._judging):
            task.cancel()
        await self.engine.close()

    # ------------------------------------------------------------------- a record gone

    RESTART_SLACK_MS = 2000
    """How early ``RequestState.records_since_ms`` may err (Redis's uptime is whole seconds)."""

    def _record_gone(self, request_id: str) -> None:
        """A write (a status update, a token) found the request's status record gone. No one
        can read its outcome through the API any more (the record is never made again), so a
        request still decoding here stops at its next step, as a cancel would; unless Redis
        itself restarted since the request was made (then the outcome still goes to the
        results topic, as the README's failure modes say of a restart)."""
        created = self.decoding.get(request_id)
        if created is None or request_id in self.gone or self.request_state is None:
            return
        task = asyncio.get_running_loop().create_task(self._judge_gone(request_id, created))
        self._judging.add(task)
        task.add_done_callback(self._judging.discard)

    async def _judge_gone(self, request_id: str, created_ms: int) -> None:
        assert self.request_state is not None
        state = await self.request_state(request_id, since=True)
        since = state.records_since_ms if state is not None else None
        if state is None or state.status is not None or since is None:
            return  # cannot tell, or it is there (again): go on
        if since + self.RESTART_SLACK_MS >= created_ms:
            log.info(
                "%s: %s lost its record with a Redis restart; going on", self.worker_id, request_id
            )
            return
        if request_id in self.decoding:
            self.gone.add(request_id)
            log.warning(
                "%s: the status record of %s went while it decoded (its TTL, an eviction, an "
                "operator); it stops",
                self.worker_id,
                request_id,
            )

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
        admitted = await self._admit(ev, updates)
        if admitted is None:
            return
        # Progress updates go out in the background: the request does not wait for the
        # broker's acknowledgement or the record write before its own work.
        updates.soon("prefilling")
        t_wait = time.perf_counter()
        outputs = await self._await_embeddings(ev, admitted, updates)
        if outputs is None:
            return
        timings = {
            "queue": float(admitted.started_ms - ev.created_ms),
            **({"broker_hop": admitted.hop_ms} if admitted.hop_ms is not None else {}),
            "admission": (t_wait - admitted.t_start) * 1000,
            "embedding_wait": (time.perf_counter() - t_wait) * 1000,
        }
        items = items_from_features(ev.features, dict(zip(admitted.keys, outputs, strict=True)))
        if self.settings.decode_stage:
            await self._hand_off(ev, items, timings, updates)
            return
        result = await self._compute(ev, items, updates)
        await self._report(ev, result, timings, updates)

    # ----------------------------------------------------------------------------- admit

    async def _admit(
        self, ev: PrefillEvent, updates: RequestUpdates, *, reads_embeddings: bool = True
    ) -> Admission | None:
        """Decide whether the request runs, reading its record, cancel flag and (when it may
        run) embeddings in one round trip. Returns None when it does not run (a redelivery of
        a finished request, a passed deadline, a cancel: each reported as such); raises the
        ``ValidationError`` of an unsafe or out-of-bounds event (the loop dead-letters it).

        ``reads_embeddings=False`` (a decode worker with a parked KV cache): the embeddings are
        neither read nor their entries' expiry judged; the caller does both if it needs them."""
        started = now_ms()
        t_start = time.perf_counter()
        hop_ms = broker_hop_ms(started)
        unsafe = self._judge_on_arrival(ev)
        hashes = dict.fromkeys(h for _, _, h in ev.features.items())
        keys = {} if unsafe else {h: ev.ec_transfer_params[h].key for h in hashes}
        fetch = reads_embeddings and unsafe is None and not deadline_passed(ev.deadline_ms, started)
        # Three independent reads, one round trip: the record (a redelivery of a finished
        # request?), the cancel flag, and the embeddings, which are often all there (a cache
        # hit, or encoded while this event travelled). Each entry holds all of an item's encoder
        # outputs (embedding, deepstack features).
        record, cancelled, present = await asyncio.gather(
            self.request_state(ev.request_id) if self.request_state else _none(),
            request_cancelled(self.cancel, ev.request_id),
            self._fetch_present(list(keys.values())) if fetch else _none(),
        )
        if record is not None and record.terminal:
            # A redelivery (crash before the offset commit, rebalance): the outcome is out
            # already, and a second terminal event would only be folded away downstream. An
            # unsafe event is still refused, whatever state its request is in.
            if unsafe is not None:
                raise unsafe
            self.skipped += 1
            log.info("%s: %s is already %s; skipped", self.worker_id, ev.request_id, record.status)
            return None
        # The deadline comes first (judged now, after the reads): the fan-out caps ec_transfer
        # expiry at the deadline, so a late event would otherwise fail validation as ec-expired
        # (rejected) instead of expiring. Nothing is run on this path.
        if deadline_passed(ev.deadline_ms, now_ms()):
            await updates.now(
                "expired", error=ErrorInfo("expired", "deadline passed before prefill")
            )
            return None
        if unsafe is not None:
            raise unsafe
        if reads_embeddings:
            validate_prefill_expiry(ev, self.vconfig)
        self.limits.check_prefill(ev)
        if cancelled:
            await self._report_cancelled(updates, "skipped before prefill")
            return None
        return Admission(keys, present, started, t_start, hop_ms)

    def _judge_on_arrival(self, ev: PrefillEvent) -> ValidationError | None:
        """Every rule but the entries' expiry, judged on arrival. An unsafe event is still
        refused (to the DLQ) only after the request's state and deadline are known, but none of
        its keys is read."""
        try:
            validate_prefill_event(ev, self._arrival_vconfig)
        except ValidationError as exc:
            return exc
        return None

    # ----------------------------------------------------------------- await embeddings

    async def _await_embeddings(
        self, ev: PrefillEvent, admitted: Admission, updates: RequestUpdates
    ) -> list[EncoderOutput] | None:
        """Every entry of the request, waiting for the ones the first read missed; None when
        the request ends here (an embedding lost or missing past the wait, a cancel: each
        reported). A store outage raises (the loop retries the event)."""
        if admitted.present is not None:
            return admitted.present
        timeout = self.embedding_wait_s
        if ev.deadline_ms is not None:
            timeout = max(0.0, min(timeout, (ev.deadline_ms - now_ms()) / 1000))
        if not await self._wait_until_present(ev, admitted, timeout, updates):
            return None
        outputs, cancelled = await asyncio.gather(
            fetch_outputs(self.store, admitted.key_list, self.bundle.family),
            request_cancelled(self.cancel, ev.request_id),
        )
        if cancelled:
            await self._report_cancelled(updates, "skipped before compute")
            return None
        return outputs

    async def _wait_until_present(
        self, ev: PrefillEvent, admitted: Admission, timeout_s: float, updates: RequestUpdates
    ) -> bool:
        """Wait up to ``timeout_s`` for the entries the first read missed: True once all are
        there; False when the request ended here (lost, missing past the wait, cancelled: each
        reported). A store outage that leaves them still coming raises (the loop retries).

        Where they stand is judged again every ``embedding_recheck_s`` of the wait, not only
        before it: a first judgement of "still coming" may have been "cannot tell" (a Redis
        just restarted answering a stale connection, a record unreadable for a moment), and an
        entry evicted or lost while the request waits sends no notification. Either way the
        request ends as ``embedding-lost`` within a recheck, not after the whole wait."""
        keys = admitted.keys
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            readiness = await self._readiness(ev, keys, updates)
            if readiness is Readiness.LOST:
                return False
            if readiness is Readiness.PRESENT:
                return True
            left = max(0.0, deadline - loop.time())
            slice_s = min(left, self.settings.embedding_recheck_s)
            try:
                if not await self._wait_unless_cancelled(admitted.key_list, slice_s, ev.request_id):
                    # The encoder skips a cancelled request's items: nothing will come.
                    await self._report_cancelled(updates, "skipped before compute")
                    return False
                return True
            except StoreUnavailable:
                # Redis went away under the wait. If it came back without the embeddings,
                # say so now rather than after a retry's full wait; else the loop retries.
                if await self._readiness(ev, keys, updates) is Readiness.LOST:
                    return False
                raise
            except StoreTimeout as exc:
                if slice_s >= left:
                    await self._report_missing(ev, keys, set(exc.missing), timeout_s, updates)
                    return False

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

    async def _readiness(
        self, ev: PrefillEvent, keys: dict[str, str], updates: RequestUpdates
    ) -> Readiness:
        """Whether the request's embeddings are all in the store, may still come (also when
        the store cannot tell), or one of them never will (reported ``failed``,
        ``embedding-lost``, here). The record is read only when something is missing."""
        try:
            present = await asyncio.gather(*(self.store.exists(k) for k in keys.values()))
        except StoreUnavailable:
            return Readiness.COMING  # cannot tell; the wait (or its retry) decides
        missing = [h for h, ok in zip(keys, present, strict=True) if not ok]
        if not missing:
            return Readiness.PRESENT
        if self.request_state is None:
            return Readiness.COMING
        state = await self.request_state(ev.request_id, since=True)
        lost = embeddings_lost(missing, state, ev.created_ms)
        if lost:
            # The record was read after the EXISTS above: an item stored and marked encoded in
            # between reads "encoded" while its key was missing then. Only a key still missing
            # now, after the record said encoded, is gone.
            try:
                again = await asyncio.gather(*(self.store.exists(keys[h]) for h in lost))
            except StoreUnavailable:
                return Readiness.COMING
            lost = [h for h, ok in zip(lost, again, strict=True) if not ok]
        if not lost:
            return Readiness.COMING
        await self._report_lost(ev, lost, updates)
        return Readiness.LOST

    # --------------------------------------------------------------------------- compute

    async def _compute(
        self, ev: PrefillEvent, items: list[ItemEmbedding], updates: RequestUpdates
    ) -> Generation:
        """Prefill and decode in the worker's batch (:mod:`gpu_workers.engine`)."""
        return await self._generate(ev, lambda: prefill(self.bundle, ev.token_ids, items), updates)

    async def _generate(
        self, ev: PrefillEvent, start: Callable[[], Prefilled], updates: RequestUpdates
    ) -> Generation:
        """Decode ``ev`` from ``start`` (run on the compute thread as it joins the batch) to
        ``max_tokens``, a stop token or string, the deadline or a cancel (asked before the
        start and between steps), streaming its tokens as they come."""
        t_compute = time.perf_counter()
        cancel = self.cancel
        rid = ev.request_id
        seq = new_sequence(self.bundle, ev.sampling, rid)
        # A worker that reads records guards its token writes by the record: none lands once
        # it went, and that is how a decoding request learns it (``_record_gone``).
        on_gone = self._record_gone if self.request_state is not None else None
        stream = self.streams.writer(rid, on_gone) if self.streams is not None else None
        if stream is not None:
            await stream.resume()
        gone = self.gone
        job = DecodeJob(
            rid,
            seq,
            start,
            kv_tokens=len(ev.token_ids) + ev.sampling.max_tokens,
            deadline_ms=ev.deadline_ms,
            # Asked on the compute thread before the start and between steps: set lookups.
            should_stop=lambda: rid in gone or (cancel is not None and cancel.cancelled_now(rid)),
            on_tokens=stream.push if stream is not None else None,
            # Sent in the background while the batch decodes.
            on_started=lambda: updates.soon("decoding"),
        )
        self.decoding[rid] = ev.created_ms
        try:
            done = await self.engine.run(job)
        except BaseException:
            if stream is not None:
                await stream.abandon()
            raise
        finally:
            self.decoding.pop(rid, None)
            stopped_gone = rid in gone
            gone.discard(rid)
        seq.settle()
        return Generation(
            done.outcome,
            seq.tokens,
            done.detail,
            compute_ms=(time.perf_counter() - t_compute) * 1000,
            text=seq.text,
            finish_reason=seq.finish_reason if done.outcome == COMPLETED else None,
            stream=stream,
            gone=stopped_gone and done.outcome == CANCELLED,
        )

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
        cancel, rid = self.cancel, ev.request_id

        def run() -> tuple[Prefilled, dict[str, torch.Tensor], float] | str:
            # Asked on the compute thread as it takes the request up, as a batch asks.
            if cancel is not None and cancel.cancelled_now(rid):
                return CANCELLED
            if deadline_passed(ev.deadline_ms, now_ms()):
                return EXPIRED
            t0 = time.perf_counter()
            state = prefill(self.bundle, ev.token_ids, items)
            return state, kv_tensors(state), (time.perf_counter() - t0) * 1000

        done = await self.engine.call(run)
        if done == CANCELLED:
            await self._report_cancelled(updates, "skipped before prefill")
            return
        if done == EXPIRED:
            await updates.now(
                "expired", error=ErrorInfo("expired", "deadline passed before prefill")
            )
            return
        assert not isinstance(done, str)
        state, tensors, prefill_ms = done
        kv = kv_entry(self.settings, self.bundle, self.store, rid, state, ev.deadline_ms)
        t_park = time.perf_counter()
        await park(self.store, kv, tensors)
        park_ms = (time.perf_counter() - t_park) * 1000
        handoff = DecodeEvent(prefill=ev, kv=kv, kv_transfer_params=ev.kv_transfer_params)
        await publish(self.publisher, self.topics, handoff)
        self.handed_off += 1
        await updates.now(
            "prefilling",
            timings={**timings, "prefill": prefill_ms, "kv_park": park_ms},
            info={HANDOFF_INFO: "decode", "kv_bytes": str(kv.nbytes)},
        )

    # ---------------------------------------------------------------------------- report

    async def _report(
        self,
        ev: PrefillEvent,
        result: Generation,
        timings: dict[str, float],
        updates: RequestUpdates,
        info: dict[str, str] | None = None,
    ) -> None:
        """The request's outcome, with its tokens and text (a stopped or expired request's
        partial output included) and, once completed, its timings, finish reason and ``info``.
        The token stream ends first, so a terminal record means a complete stream."""
        if result.stream is not None:
            await result.stream.close(result.outcome, result.finish_reason)
        if result.gone:
            await self._report_cancelled(
                updates, GONE_DETAIL, result.tokens, result.text, code="status-gone"
            )
            return
        if result.outcome == "cancelled":
            await self._report_cancelled(updates, result.detail, result.tokens, result.text)
            return
        if result.outcome == "expired":
            await updates.now(
                "expired",
                token_ids=result.tokens,
                text=result.text,
                error=ErrorInfo("expired", result.detail),
            )
            return
        self.completed += 1
        await updates.now(
            "completed",
            token_ids=result.tokens,
            text=result.text,
            timings={
                **timings,
                "prefill_decode": result.compute_ms,
                "total": float(now_ms() - ev.created_ms),
            },
            info={"finish_reason": result.finish_reason or "", **(info or {})},
        )

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
            "expired" if deadline_passed(ev.deadline_ms, now_ms()) else "failed",
            error=ErrorInfo(
                "embeddings-missing",
                f"embeddings for {len(missing)} item(s) not in the store after {waited_s:.1f}s: "
                + ", ".join(h[:16] for h in missing),
                modality=modality,
                item=index,
            ),
        )

    async def _report_lost(
        self, ev: PrefillEvent, lost: list[str], updates: RequestUpdates
    ) -> None:
        """``failed``, ``embedding-lost``, naming the first lost item."""
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

    async def _report_cancelled(
        self,
        updates: RequestUpdates,
        what: str,
        tokens: list[int] | None = None,
        text: str | None = None,
        *,
        code: str = "cancelled",
    ) -> None:
        """``cancelled``, with the tokens made before the cancel took effect (if any);
        ``code`` ``status-gone``: stopped because the request's record went."""
        self.cancelled += 1
        await updates.now(
            "cancelled",
            token_ids=tokens or None,
            text=text if tokens else None,
            error=ErrorInfo(code, f"cancelled: {what}"),
            # info survives in the record even though the API's cancel was the terminal status
            info={"prefill.cancelled": what},
        )


async def _none() -> None:
    """An awaitable None (a read this worker was not given)."""
    return None
