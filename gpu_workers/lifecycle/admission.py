"""Admission: whether a request a GPU worker was sent runs here, and what it starts from.

Validation is strict (a metadata-only item without a valid ``ec_transfer_params`` entry is
rejected before anything runs), and so are the bounds of what runs: the door's own
:class:`runtime.request_limits.RequestLimits`, built from the settings and this model's
vocabulary and context (:func:`worker_limits`), so an event written straight to the topic is
refused with the rule and message the door gives.

The request's status record (a redelivery of a finished request?), its cancel flag and, for a
request that runs from its embeddings, the embeddings themselves are read in one round trip.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_workers.compute import context_length, vocab_size
from gpu_workers.entries import fetch_outputs, request_cancelled
from runtime.request_limits import RequestLimits
from runtime.stores.errors import StoreError
from runtime.tracing import broker_hop_ms
from schemas.errors import ValidationError
from schemas.types import now_ms
from schemas.validator import validate_decode_event, validate_prefill_event, validate_prefill_expiry
from schemas.values import deadline_passed

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from gpu_workers.compute import EncoderOutput
    from gpu_workers.context import WorkerContext
    from gpu_workers.lifecycle.outcomes import Outcomes
    from runtime.model import ModelBundle
    from runtime.reporting import RequestUpdates
    from runtime.settings import Settings
    from runtime.status import RequestState, RequestStateReader
    from runtime.stores.base import EmbeddingStore
    from schemas.families import ModelFamily
    from schemas.kv_entries import KVShape
    from schemas.types import DecodeEvent, PrefillEvent

log = logging.getLogger(__name__)


def worker_limits(settings: Settings, bundle: ModelBundle) -> RequestLimits:
    """The door's :class:`RequestLimits` for this model: the settings, held to what the model
    knows (its vocabulary and context), as the API builds them from the model's render info."""
    return RequestLimits.from_settings(
        settings, vocab_size=vocab_size(bundle), model_context=context_length(bundle)
    )


async def read_if_present(
    store: EmbeddingStore, keys: Sequence[str], family: ModelFamily
) -> list[EncoderOutput] | None:
    """Every entry of ``keys`` if all are in the store now (one read), else None.

    A read ahead of the request's checks: it fails quietly (None), so a store error never
    decides ahead of them; the wait and the read after it surface it."""
    try:
        return await fetch_outputs(store, keys, family)
    except StoreError:
        return None


@dataclass(slots=True)
class Admitted:
    """A request let in to run: its store keys and what the first read found."""

    keys: dict[str, str]
    """mm_hash -> its entry's store key, in the request's item order."""
    present: list[EncoderOutput] | None
    """Every entry, when all were in the store at the first read (else None)."""
    started_ms: int
    t_start: float
    hop_ms: float | None
    awaited: list[str] = dataclasses.field(default_factory=list)
    """The items (mm_hash) the embedding wait found missing and waited for: their encoder
    writes their marks (:meth:`EmbeddingWait.marks_landed`)."""

    @property
    def key_list(self) -> list[str]:
        return list(self.keys.values())


@dataclass(slots=True)
class _Arrival:
    """An event as it arrived: when, and what the rules judged of it before any read."""

    started_ms: int
    t_start: float
    hop_ms: float | None
    unsafe: ValidationError | None
    """The rule it breaks (every rule but the entries' expiry), refused once its state is known."""
    keys: dict[str, str]
    """Its entries' store keys (none for an unsafe event: none of them is read)."""


class AdmissionGate:
    """Decides whether a request runs, reading its record and cancel flag in one round trip.

    :meth:`admit` is the door of a request that runs from its embeddings (a prefill worker;
    they are read along); :meth:`admit_handed_over` of one that starts from a parked KV cache
    (a decode worker; neither the embeddings nor their entries' expiry). Either returns None
    when the request does not run (a redelivery of a finished request, a passed deadline, a
    cancel: each reported as such) and raises the ``ValidationError`` of an unsafe or
    out-of-bounds event (the loop dead-letters it).
    """

    def __init__(
        self,
        ctx: WorkerContext,
        outcomes: Outcomes,
        *,
        worker_id: str,
        request_state: RequestStateReader | None = None,
        on_record: Callable[[str, RequestState | None], object] | None = None,
    ) -> None:
        """``request_state``: a request whose record is already terminal (a redelivered
        event) is skipped without a word. ``on_record`` is told what that read found
        (``RecordWatch.admitted``)."""
        self.store = ctx.store
        self.family = ctx.bundle.family
        self.cancel = ctx.cancel
        self.outcomes = outcomes
        self.worker_id = worker_id
        self.request_state = request_state
        self.on_record = on_record
        self.vconfig = ctx.validation()
        # Every event is checked on arrival without its entries' expiry, which is judged
        # (validate_prefill_expiry) only once the request is known to run: arriving late is no
        # offence for a redelivery of a finished request (nothing runs), and a late one expires.
        self.arrival_vconfig = dataclasses.replace(self.vconfig, now_ms=None)
        self.limits = worker_limits(ctx.settings, ctx.bundle)

    async def admit(self, ev: PrefillEvent, updates: RequestUpdates) -> Admitted | None:
        """A request that runs from its embeddings: they are read beside the record and the
        cancel flag (often all there: a cache hit, or encoded while this event travelled), and
        its entries' expiry is judged once it is known to run."""
        arrival = self._arrive(ev)
        fetch = arrival.unsafe is None and not deadline_passed(ev.deadline_ms, arrival.started_ms)
        record, cancelled, present = await asyncio.gather(
            self._record(ev),
            request_cancelled(self.cancel, ev.request_id),
            read_if_present(self.store, list(arrival.keys.values()), self.family)
            if fetch
            else _none(),
        )
        if not await self._runs(ev, arrival, record, updates):
            return None
        self.check_entries_expiry(ev)
        return await self._bounded(ev, arrival, cancelled, present, updates)

    async def admit_handed_over(self, ev: PrefillEvent, updates: RequestUpdates) -> Admitted | None:
        """A request handed over with a parked KV cache (``ev`` the prefill event it carries):
        its embeddings are neither read nor their entries' expiry judged; a caller that falls
        back on them does both (:meth:`check_entries_expiry`)."""
        arrival = self._arrive(ev)
        record, cancelled = await asyncio.gather(
            self._record(ev), request_cancelled(self.cancel, ev.request_id)
        )
        if not await self._runs(ev, arrival, record, updates):
            return None
        return await self._bounded(ev, arrival, cancelled, None, updates)

    def check_handoff(self, dev: DecodeEvent, shape: KVShape) -> None:
        """The decode rules of a hand-over and every prefill rule but the entries' expiry."""
        validate_decode_event(dev, self.arrival_vconfig, shape)

    def check_entries_expiry(self, ev: PrefillEvent) -> None:
        """The request's embedding entries have not expired (rule ``ec-expired``)."""
        validate_prefill_expiry(ev, self.vconfig)

    def _arrive(self, ev: PrefillEvent) -> _Arrival:
        started = now_ms()
        t_start = time.perf_counter()
        hop_ms = broker_hop_ms(started)
        unsafe = self._judge_on_arrival(ev)
        hashes = dict.fromkeys(h for _, _, h in ev.features.items())
        keys = {} if unsafe else {h: ev.ec_transfer_params[h].key for h in hashes}
        return _Arrival(started, t_start, hop_ms, unsafe, keys)

    def _judge_on_arrival(self, ev: PrefillEvent) -> ValidationError | None:
        """Every rule but the entries' expiry, judged on arrival. An unsafe event is still
        refused (to the DLQ) only after the request's state and deadline are known, but none of
        its keys is read."""
        try:
            validate_prefill_event(ev, self.arrival_vconfig)
        except ValidationError as exc:
            return exc
        return None

    async def _record(self, ev: PrefillEvent) -> RequestState | None:
        if self.request_state is None:
            return None
        state = await self.request_state(ev.request_id)
        if self.on_record is not None:
            self.on_record(ev.request_id, state)
        return state

    async def _runs(
        self,
        ev: PrefillEvent,
        arrival: _Arrival,
        record: RequestState | None,
        updates: RequestUpdates,
    ) -> bool:
        """False for a redelivery of a finished request (skipped) or a passed deadline
        (reported ``expired``); an unsafe event raises its rule here, after both."""
        if record is not None and record.terminal:
            # A redelivery (crash before the offset commit, rebalance): the outcome is out
            # already, and a second terminal event would only be folded away downstream. An
            # unsafe event is still refused, whatever state its request is in.
            if arrival.unsafe is not None:
                raise arrival.unsafe
            self.outcomes.tally.skipped += 1
            log.info("%s: %s is already %s; skipped", self.worker_id, ev.request_id, record.status)
            return False
        # The deadline comes first (judged now, after the reads): the fan-out caps ec_transfer
        # expiry at the deadline, so a late event would otherwise fail validation as ec-expired
        # (rejected) instead of expiring. Nothing is run on this path.
        if deadline_passed(ev.deadline_ms, now_ms()):
            await self.outcomes.expired(updates, "prefill")
            return False
        if arrival.unsafe is not None:
            raise arrival.unsafe
        return True

    async def _bounded(
        self,
        ev: PrefillEvent,
        arrival: _Arrival,
        cancelled: bool,
        present: list[EncoderOutput] | None,
        updates: RequestUpdates,
    ) -> Admitted | None:
        """The door's bounds (raising their rule), then the cancel flag read on arrival."""
        self.limits.check_prefill(ev)
        if cancelled:
            await self.outcomes.cancelled(updates, "skipped before prefill")
            return None
        return Admitted(arrival.keys, present, arrival.started_ms, arrival.t_start, arrival.hop_ms)


async def _none() -> None:
    """An awaitable None (a read this request does not make)."""
    return None
