"""Fan-out: one RenderEvent -> EncodeEvents (heavy inputs) + one PrefillEvent (metadata only).

The prefill side never sees ``pixel_values``: it gets the placeholder metadata and a signed
``ec_transfer_params`` entry per item telling it where the encoder output will be parked.
Encoder inputs above the inline limit travel as a claim check (TensorRef) in the store, and an
item whose embedding is already in the store is not sent to the encoder at all.

Store keys come from the fan-out's own hash (``schemas.signing.ItemHasher``) over each item's
encoder inputs, the processor config, the model fingerprint and the request's ``cache_salt``;
an event's ``mm_hash`` is only a label. Our renderer labels items with that same hash, so a
label that differs is refused (rule ``mm-hash-mismatch``): it would otherwise let anyone who can
write to the render topic get signed entries, and cache hits, for another tenant's key. Each
entry's signature also binds the request id, so it cannot be replayed into another request.

Encoder inputs travel in ``EPD_PIXEL_DTYPE`` (:func:`runtime.processor_limits.pixel_dtype_name`):
a bf16 transport halves the bytes on the encode topic and in the store. The cast happens here,
after hashing, so the store key names the processor's output whatever the transport; the encode
worker casts to its model dtype anyway, so a bf16 model sees the same values either way.

Inline tensors are ``torch.Tensor`` or, in the render router, which imports no torch,
:class:`schemas.wire_tensor.WireTensor`: the fan-out reads them through :mod:`schemas.tensor_ops`
only, and needs of the model only its :class:`runtime.render_keys.RenderKeys`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runtime.processor_limits import InputLimits, limits_for, pixel_dtype_name
from runtime.publisher import Publisher, publish
from runtime.render_keys import RenderKeys, render_keys_of
from runtime.reporting import ResultReporter, StatusWriter
from runtime.settings import Settings
from schemas import tensor_ops
from schemas.codec import get_codec
from schemas.errors import CodecError, ValidationError
from schemas.keys import claim_key, embedding_key
from schemas.modalities import ENCODER_INPUT_FIELDS, METADATA_FIELDS
from schemas.signing import (
    INLINE_DIGEST_BYTES,
    ItemHasher,
    make_ec_transfer,
    tensor_digest,
    undigested_bytes,
)
from schemas.status_record import fanout_info
from schemas.topics import Topics
from schemas.types import (
    ECTransfer,
    EncodeEvent,
    Features,
    ItemData,
    PrefillEvent,
    RenderEvent,
    ResultEvent,
    TensorRef,
    now_ms,
)
from schemas.validator import ValidationConfig, validate_render_event

if TYPE_CHECKING:
    from runtime.model import RenderInfo
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)

OpeningWrite = Callable[[ResultEvent, dict[str, Any]], Awaitable[object]]
"""Makes a request's status record with the fan-out's update (and its record fields) folded
in: ``StatusStore.create(..., first=, first_fields=)`` for the request (:meth:`FanOut.publish`)."""


@dataclass(slots=True)
class FanoutPlan:
    """What one RenderEvent turns into, before anything is sent."""

    encode: list[EncodeEvent]
    prefill: PrefillEvent
    cached: list[str] = field(default_factory=list)
    """mm_hashes whose embeddings were already in the store (no encode event)."""
    claim_bytes: int = 0
    """Encoder-input bytes parked in the store as claim checks for the encode events."""
    values: dict[int, bytes] = field(default_factory=dict)
    """Each event's encoding (by the event's ``id``), made when it was checked: what is sent."""

    def value_of(self, event: EncodeEvent | PrefillEvent) -> bytes | None:
        """``event``'s encoding, made by the plan (None for an event it did not make)."""
        return self.values.get(id(event))


@dataclass(slots=True)
class FanoutStats:
    """Bytes and counts of one published request, for the demo summary and benchmarks."""

    encode_events: int
    cache_hits: int
    encode_bytes: int
    prefill_bytes: int
    kwargs_bytes: int
    """What the prefill event would weigh had it carried the full ``kwargs_data``."""
    cached: list[str] = field(default_factory=list)
    """mm_hashes found in the store (no encode event); the API reports them per item."""
    claim_bytes: int = 0
    """Encoder-input bytes parked in the store as claim checks (beside the encode topic)."""


def claim_ttl_s(settings: Settings, deadline_ms: int | None, now: int | None = None) -> float:
    """Lifetime of a claim check: ``EPD_CLAIM_TTL_S``, capped by the request's deadline (past
    it the encode worker expires the event unread). The encode worker deletes the claim once the
    embedding is stored; the TTL only bounds claims nobody came for."""
    ttl = float(settings.claim_ttl_s)
    if deadline_ms is not None:
        left_ms = deadline_ms - (now if now is not None else now_ms())
        ttl = min(ttl, max(1.0, left_ms / 1000))
    return ttl


@dataclass(slots=True)
class HashedItem:
    """One item of a RenderEvent with the hash the fan-out computed for it."""

    modality: str
    index: int
    label: str
    """The event's ``mm_hash`` for the item."""
    key_hash: str
    """The fan-out's own hash: what the store key is made of."""
    data: ItemData
    digests: dict[str, str]
    """blake3 of each inline tensor's bytes, reused for claim checks."""


def hash_items(
    ev: RenderEvent, hasher: ItemHasher, *, foreign_labels: bool = False
) -> list[HashedItem]:
    """Every item of a validated RenderEvent with the fan-out's own hash of it.

    Rule ``mm-hash-mismatch``: an item whose ``mm_hash`` is not that hash is refused, naming the
    item, unless ``foreign_labels`` says the labels come from another renderer (a vLLM render):
    then they stay labels and only our hash keys the store. CPU-bound (digests of inline
    tensors): run it in a worker thread.
    """
    out: list[HashedItem] = []
    for modality, index, label in ev.features.items():
        data = (ev.features.kwargs_data or {})[modality][index]
        if data is None:  # validate_render_event refuses this; keep the rule explicit anyway
            raise ValidationError(
                "render-data-missing",
                "render events carry full kwargs_data for every item",
                modality=modality,
                item=index,
            )
        digests = {n: tensor_digest(v) for n, v in data.items() if tensor_ops.is_tensor(v)}
        key_hash = hasher.item_hash(modality, data, ev.cache_salt, digests=digests)
        if label != key_hash and not foreign_labels:
            raise ValidationError(
                "mm-hash-mismatch",
                f"mm_hash {label!r} is not the hash of the item's encoder inputs, processor "
                f"config, model and cache_salt ({key_hash!r})",
                modality=modality,
                item=index,
                field="mm_hashes",
            )
        out.append(HashedItem(modality, index, label, key_hash, data, digests))
    return out


async def _hashed(ev: RenderEvent, hasher: ItemHasher, foreign_labels: bool) -> list[HashedItem]:
    """:func:`hash_items`, in a worker thread when it has megabytes to digest (a render in this
    process left its tensors' digests on them: then the hashes are made here, a thread's
    hand-off costing more than they do)."""
    data = (ev.features.kwargs_data or {}).values()
    values = (v for items in data for item in items if item for v in item.values())
    if undigested_bytes(values) <= INLINE_DIGEST_BYTES:
        return hash_items(ev, hasher, foreign_labels=foreign_labels)
    return await asyncio.to_thread(hash_items, ev, hasher, foreign_labels=foreign_labels)


def check_upstream_refs(items: list[HashedItem], namespace: str, store_url: str) -> None:
    """Rule ``claim-check``: a TensorRef already in a RenderEvent must sit at its own item's
    claim key in our store. The hash trusts a ref's digest (the encoder checks the bytes against
    it), so a ref pointing at another tenant's parked inputs would otherwise get them encoded
    under the sender's key."""
    for it in items:
        for name, v in it.data.items():
            if not isinstance(v, TensorRef):
                continue
            want = claim_key(namespace, it.key_hash, name)
            if v.store != store_url or v.key != want:
                raise ValidationError(
                    "claim-check",
                    f"TensorRef {v.store}/{v.key} is not this item's claim key {store_url}/{want}",
                    modality=it.modality,
                    item=it.index,
                    field=name,
                )


def _unique(items: list[HashedItem]) -> list[HashedItem]:
    """The first item of each key hash (a repeated image is encoded once)."""
    seen: set[str] = set()
    out = []
    for it in items:
        if it.key_hash not in seen:
            seen.add(it.key_hash)
            out.append(it)
    return out


class FanOut:
    """Plans and publishes the fan-out of rendered requests."""

    def __init__(
        self,
        settings: Settings,
        store: EmbeddingStore,
        info: RenderInfo | RenderKeys,
        *,
        publisher: Publisher | None = None,
        topics: Topics | None = None,
        record: StatusWriter | None = None,
        routed: bool = False,
    ) -> None:
        """``info``: the model's ``RenderInfo`` (no weights) or just its ``RenderKeys``: its
        fingerprint and processor config go into the hash the store is keyed by. Without a
        ``publisher`` the fan-out can only :meth:`plan` (benchmarks, tests). ``record``
        (``StatusStore.apply``): the fan-out's status update is also written to the request's
        record directly (see ResultReporter). ``routed``: the render router's fan-out, the
        entry point of its requests, whose update makes their records
        (``schemas.status_record.makes_record``); behind the intake, which made the record, it
        only updates it."""
        self.settings = settings
        self.store = store
        self.info = info
        keys = info if isinstance(info, RenderKeys) else render_keys_of(info)
        self.model_fingerprint = keys.fingerprint
        self.hasher = ItemHasher(keys.fingerprint, bytes.fromhex(keys.processor_digest))
        self.publisher = publisher
        self.topics = topics or Topics(settings.topic_prefix)
        self.record = record
        self.routed = routed
        self._secret = settings.secret_bytes()
        self.limits: InputLimits = limits_for(settings, keys.max_pixels, keys.temporal_patch_size)
        self.pixel_dtype = pixel_dtype_name(settings)
        """The wire name of ``EPD_PIXEL_DTYPE``'s dtype."""
        # Structure only: scanning megabytes of pixels for NaN/Inf here would dominate the
        # cache-hit path; the encode worker checks values when it reads them.
        self._vconfig = ValidationConfig.from_settings(
            settings, check_values=False, max_tensor_bytes=self.limits.max_tensor_bytes
        )

    def store_key(self, key_hash: str) -> str:
        """The embedding store key for one of the fan-out's own hashes."""
        return embedding_key(self.settings.ec_namespace, self.model_fingerprint, key_hash)

    def ec_transfer(
        self, request_id: str, label: str, key_hash: str, deadline_ms: int | None
    ) -> ECTransfer:
        """A signed entry for one item of one request; it expires with the embedding's TTL or
        the deadline. ``label`` is the event's ``mm_hash``, ``key_hash`` our own hash."""
        expires = now_ms() + self.settings.embedding_ttl_s * 1000
        if deadline_ms is not None:
            expires = min(expires, deadline_ms)
        return make_ec_transfer(
            mm_hash=label,
            store=self.store.url,
            key=self.store_key(key_hash),
            expires_ms=expires,
            secret=self._secret,
            request_id=request_id,
        )

    def _recast(self, name: str, value: Any) -> bool:
        """Whether an input travels cast to ``EPD_PIXEL_DTYPE``: fp32 encoder inputs only (never
        an upcast; metadata and integer tensors travel as they are)."""
        return (
            name in ENCODER_INPUT_FIELDS
            and tensor_ops.dtype_name(value) == "float32"
            and self.pixel_dtype != "float32"
        )

    async def _inline_or_claim(
        self, item: HashedItem, deadline_ms: int | None
    ) -> tuple[ItemData, int]:
        """The item's data as the encode event carries it, and the bytes claim-checked."""
        out: ItemData = {}
        claimed = 0
        for name, value in item.data.items():
            if isinstance(value, TensorRef):
                out[name] = value  # already claim-checked upstream
                continue
            digest = item.digests[name]
            if self._recast(name, value):
                # Casting megabytes takes milliseconds: off the event loop. The hash-time digest
                # was of the fp32 bytes; the cast tensor's is computed below if it is claimed.
                value = await asyncio.to_thread(tensor_ops.cast, value, self.pixel_dtype)
                digest = ""
            nbytes = tensor_ops.nbytes(value)
            # Metadata (the grid) always travels inline: it is a few bytes, and the validator
            # and encoder need it without a store round trip (a claim-checked grid is rejected).
            if name in METADATA_FIELDS or nbytes <= self.settings.inline_limit_bytes:
                out[name] = value
                continue
            if not tensor_ops.is_contiguous(value):  # a copy of megabytes: off the event loop
                value = await asyncio.to_thread(value.contiguous)  # type: ignore[union-attr]
            # The store is handed the tensor's own bytes as a flat uint8 view, as put_bytes
            # would store them, without copying them first (a 12 MP photo's are 292 MB; the
            # Redis store writes straight from the view). The fan-out never changes a tensor.
            raw = tensor_ops.byte_tensor(value)
            if not digest:  # the hash-time digest was of the fp32 bytes: hash the cast ones
                digest = await asyncio.to_thread(tensor_digest, value)
            key = claim_key(self.settings.ec_namespace, item.key_hash, name)
            await self.store.put(key, raw, claim_ttl_s(self.settings, deadline_ms))
            claimed += nbytes
            out[name] = TensorRef(
                store=self.store.url,
                key=key,
                dtype=tensor_ops.wire_dtype(value),
                shape=list(value.shape),
                nbytes=nbytes,
                digest=digest,
            )
        return out, claimed

    async def plan(self, ev: RenderEvent, *, foreign_labels: bool = False) -> FanoutPlan:
        """Validate a RenderEvent and build its encode and prefill events (claim checks stored).

        Every event is built and encoded before anything is stored or sent: an event the wire
        format cannot carry (a token id beyond int64) is refused (rule ``event-encoding``)
        before it can leave half a request behind. ``foreign_labels``: see :func:`hash_items`
        (the events keep the render's labels)."""
        validate_render_event(ev, self._vconfig)
        if ev.deadline_ms is None:
            # The door every request passes: one without a deadline gets the default one, so
            # no request can stay unfinished for ever (the sweep ends it past its deadline).
            ev = dataclasses.replace(
                ev, deadline_ms=now_ms() + int(self.settings.request_timeout_s * 1000)
            )
        hashed = await _hashed(ev, self.hasher, foreign_labels)
        items = _unique(hashed)
        check_upstream_refs(items, self.settings.ec_namespace, self.store.url)
        # One entry per label: with foreign labels two labels may name one content hash.
        params = {
            it.label: self.ec_transfer(ev.request_id, it.label, it.key_hash, ev.deadline_ms)
            for it in hashed
        }
        prefill = self._prefill_event(ev, params)
        values = {id(prefill): _encoded(prefill)}
        encode, cached, claim_bytes = await self._encode_events(ev, items, params)
        values.update((id(enc), _encoded(enc)) for enc in encode)
        return FanoutPlan(encode, prefill, cached, claim_bytes, values)

    def _prefill_event(self, ev: RenderEvent, params: dict[str, ECTransfer]) -> PrefillEvent:
        f = ev.features
        return PrefillEvent(
            request_id=ev.request_id,
            model=ev.model,
            token_ids=list(ev.token_ids),
            features=Features(
                mm_hashes=f.mm_hashes,
                mm_placeholders=f.mm_placeholders,
                kwargs_data=None,
                mm_metadata=prefill_metadata(f),
            ),
            ec_transfer_params=params,
            sampling=ev.sampling,
            cache_salt=ev.cache_salt,
            deadline_ms=ev.deadline_ms,
            trace=dict(ev.trace),
            kv_transfer_params=ev.kv_transfer_params,  # vLLM's, on to prefill and decode as is
        )

    async def _encode_events(
        self, ev: RenderEvent, items: list[HashedItem], params: dict[str, ECTransfer]
    ) -> tuple[list[EncodeEvent], list[str], int]:
        """The encode events of the items not in the store yet (their large inputs parked as
        claim checks), the labels of those that are, and the bytes claim-checked."""

        async def lookup(it: HashedItem) -> tuple[ItemData, int] | None:
            """None for a hit; else the item's encode-event data and its claimed bytes."""
            # A hit must outlive the entry's promise (now + embedding_ttl_s): touch, not exists.
            if await self.store.touch(params[it.label].key, self.settings.embedding_ttl_s):
                return None
            return await self._inline_or_claim(it, ev.deadline_ms)

        # Every item at once: a many-image request costs one store round trip, not one each.
        found = await asyncio.gather(*(lookup(it) for it in items))
        encode: list[EncodeEvent] = []
        cached: list[str] = []
        claim_bytes = 0
        for it, miss in zip(items, found, strict=True):
            if miss is None:
                cached.append(it.label)
                continue
            data, claimed = miss
            claim_bytes += claimed
            encode.append(
                EncodeEvent(
                    request_id=ev.request_id,
                    model=ev.model,
                    modality=it.modality,
                    item_index=it.index,
                    mm_hash=it.label,
                    data=data,
                    ec_transfer=params[it.label],
                    deadline_ms=ev.deadline_ms,
                    trace=dict(ev.trace),
                )
            )
        return encode, cached, claim_bytes

    async def publish(
        self,
        ev: RenderEvent,
        *,
        foreign_labels: bool = False,
        after: Awaitable[object] | None = None,
        opening: OpeningWrite | None = None,
    ) -> FanoutStats:
        """Plan, record the stage update, then send it, the encode events and the prefill event.

        ``after``: an earlier write of the request's record (the submitter's ``queued``) that
        ran beside the planning; it must be done before this stage's update is recorded or
        anything is sent, and its failure stops the publish. ``opening`` instead makes the
        record with this stage's update in it (one write where the two took two): it is done
        before anything is sent, and its failure stops the publish."""
        publisher = self.publisher
        if publisher is None:
            raise RuntimeError("FanOut.publish needs a publisher")
        t0 = time.perf_counter()
        plan = await self.plan(ev, foreign_labels=foreign_labels)
        if after is not None:
            await after
        reporter = ResultReporter(publisher, self.topics.results, "fanout", record=self.record)
        update = reporter.update(
            ev.request_id,
            "encoding" if plan.encode else "prefilling",
            timings={"fanout": (time.perf_counter() - t0) * 1000},
            info={
                **fanout_info(
                    encode_events=len(plan.encode),
                    deadline_ms=plan.prefill.deadline_ms,
                    routed=self.routed,
                ),
                "cache_hits": str(len(plan.cached)),
            },
        )
        if opening is not None:
            # No worker may see the request before its record exists: its updates would find
            # none (and stop, as for a record that went).
            await opening(update, {"cached": list(plan.cached)})
        # The encode events go at once: the encoder's marks carry "encoding" too, so one that
        # reaches the record before this update costs a client streaming the statuses nothing.
        encodes = asyncio.gather(
            *(publish(publisher, self.topics, e, value=plan.value_of(e)) for e in plan.encode)
        )
        if opening is not None:
            _, encode_sizes, prefill_bytes = await asyncio.gather(
                reporter.send(update, recorded=True), encodes, self._send_prefill(plan)
            )
        elif self.record is not None:
            encode_sizes, prefill_bytes = await self._send_recorded(plan, reporter, update, encodes)
        else:
            # No record at hand: the results topic holds the order, so the update is
            # acknowledged (with the encode events, all in flight) before the prefill event.
            _, encode_sizes = await asyncio.gather(reporter.send(update), encodes)
            prefill_bytes = await self._send_prefill(plan)
        return _stats(ev, plan, sum(encode_sizes), prefill_bytes)

    async def _send_recorded(
        self,
        plan: FanoutPlan,
        reporter: ResultReporter,
        update: ResultEvent,
        encodes: Awaitable[list[int]],
    ) -> tuple[list[int], int]:
        """The update written through (with the items found cached, in the same write), then
        sent; the encode events beside it and the prefill event in its turn: the sizes sent.

        The request's "encoding" status must be recorded before any prefill worker can record
        "prefilling", or a client streaming the statuses never sees it; a prefill worker only
        can once it has the prefill event, so that waits for the record (one round trip). All
        cached, this update is "prefilling" itself, as the prefill worker's first is: the two
        may land in either order and the prefill event goes at once. (Only a worker whose
        first word is an outcome, a cancel or a passed deadline could beat this write; the
        status then goes from queued to that outcome.)"""
        recorded = asyncio.ensure_future(
            reporter.write_through(update, fields={"cached": list(plan.cached)})
        )
        if plan.encode:
            await recorded

        async def send_update() -> None:
            await reporter.send(update, recorded=await recorded)

        _, encode_sizes, prefill_bytes = await asyncio.gather(
            send_update(), encodes, self._send_prefill(plan)
        )
        return encode_sizes, prefill_bytes

    async def _send_prefill(self, plan: FanoutPlan) -> int:
        assert self.publisher is not None
        return await publish(
            self.publisher, self.topics, plan.prefill, value=plan.value_of(plan.prefill)
        )


def _stats(ev: RenderEvent, plan: FanoutPlan, encode_bytes: int, prefill_bytes: int) -> FanoutStats:
    return FanoutStats(
        encode_events=len(plan.encode),
        cache_hits=len(plan.cached),
        encode_bytes=encode_bytes,
        prefill_bytes=prefill_bytes,
        kwargs_bytes=kwargs_bytes(ev.features),
        cached=list(plan.cached),
        claim_bytes=plan.claim_bytes,
    )


def _encoded(event: EncodeEvent | PrefillEvent) -> bytes:
    """Rule ``event-encoding``: the event encodes (Avro longs are int64: a larger token id or
    offset cannot travel). Checked by encoding it, so no other limit can drift from the wire's;
    the bytes are what is sent (one encode per event)."""
    try:
        return get_codec().encode(event)
    except (CodecError, ValueError, OverflowError, TypeError) as exc:
        raise ValidationError(
            "event-encoding", f"the {type(event).__name__} cannot be encoded: {exc}"
        ) from None


def build_fanout(
    settings: Settings,
    store: EmbeddingStore,
    info: RenderInfo | RenderKeys,
    publisher: Publisher,
    *,
    record: StatusWriter | None = None,
    routed: bool = False,
) -> FanOut:
    """The one place a publishing FanOut is assembled (router, Submitter, demo, verify).

    ``record``: write the fan-out's status update through to the status record (pass
    ``StatusStore.apply`` wherever the status store is at hand). ``routed``: the render
    router's (its update makes the request's record)."""
    return FanOut(
        settings,
        store,
        info,
        publisher=publisher,
        topics=Topics(settings.topic_prefix),
        record=record,
        routed=routed,
    )


def prefill_metadata(f: Features) -> dict[str, list[ItemData | None]] | None:
    """Each item's metadata for prefill: its ``mm_metadata`` slot, or else the metadata fields
    of its full data (a renderer may leave ``mm_metadata`` out; prefill still needs the grid).

    Follows the slots-across-modalities rule: a full-length list for every modality once any
    item has metadata, and None only when no item has any.
    """
    out: dict[str, list[ItemData | None]] = {}
    for modality, hashes in f.mm_hashes.items():
        slots: list[ItemData | None] = []
        for i in range(len(hashes)):
            meta = (f.mm_metadata or {}).get(modality, [None] * len(hashes))[i]
            if meta is None:
                full = (f.kwargs_data or {}).get(modality, [None] * len(hashes))[i] or {}
                meta = {k: v for k, v in full.items() if k in METADATA_FIELDS} or None
            slots.append(meta)
        out[modality] = slots
    return out if any(m is not None for slots in out.values() for m in slots) else None


def kwargs_bytes(features: Features) -> int:
    """Raw tensor bytes of every item's full processor output.

    A lower bound of what shipping ``kwargs_data`` to prefill costs (vLLM's JSON path adds
    base64's third on top).
    """
    total = 0
    for items in (features.kwargs_data or {}).values():
        for item in items:
            for v in (item or {}).values():
                total += v.nbytes if isinstance(v, TensorRef) else tensor_ops.nbytes(v)
    return total
