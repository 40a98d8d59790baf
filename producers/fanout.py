"""Fan-out: one RenderEvent -> EncodeEvents (heavy inputs) + one PrefillEvent (metadata only).

The prefill side never sees ``pixel_values``: it gets the placeholder metadata and a signed
``ec_transfer_params`` entry per item telling it where the encoder output will be parked.
Encoder inputs above the inline limit travel as a claim check (TensorRef) in the store, and an
item whose embedding is already in the store is not sent to the encoder at all.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import blake3
import torch

from runtime.kafka import ResultReporter, event_headers
from runtime.settings import Settings
from schemas.codec import get_codec
from schemas.signing import embedding_key, make_ec_transfer
from schemas.tensors import dtype_name, tensor_bytes
from schemas.topics import Topics
from schemas.types import (
    ECTransfer,
    EncodeEvent,
    Features,
    ItemData,
    PrefillEvent,
    RenderEvent,
    TensorRef,
    now_ms,
)
from schemas.validator import DEFAULT_METADATA_FIELDS, ValidationConfig, validate_render_event

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FanoutPlan:
    """What one RenderEvent turns into, before anything is sent."""

    encode: list[EncodeEvent]
    prefill: PrefillEvent
    cached: list[str] = field(default_factory=list)
    """mm_hashes whose embeddings were already in the store (no encode event)."""


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


def claim_key(namespace: str, mm_hash: str, field_name: str) -> str:
    """Store key of a claim-checked encoder input."""
    return f"{namespace}:claim:{mm_hash}:{field_name}"


def _unique_items(features: Features) -> list[tuple[str, int, str]]:
    """(modality, index, mm_hash) for the first occurrence of each mm_hash."""
    seen: set[str] = set()
    out = []
    for modality, index, mm_hash in features.items():
        if mm_hash not in seen:
            seen.add(mm_hash)
            out.append((modality, index, mm_hash))
    return out


class FanOut:
    """Plans and publishes the fan-out of rendered requests."""

    def __init__(
        self,
        settings: Settings,
        store: EmbeddingStore,
        model_fingerprint: str,
        *,
        producer: AIOKafkaProducer | None = None,
        prefill_producer: AIOKafkaProducer | None = None,
        topics: Topics | None = None,
    ) -> None:
        """``prefill_producer`` (default: ``producer``) sends the prefill events; give it
        ``settings.prefill_compression`` so the small, repetitive events travel compressed
        while the encoder inputs stay uncompressed."""
        self.settings = settings
        self.store = store
        self.model_fingerprint = model_fingerprint
        self.producer = producer
        self.prefill_producer = prefill_producer or producer
        self.topics = topics or Topics(settings.topic_prefix)
        self._secret = settings.secret_bytes()
        # Structure only: scanning megabytes of pixels for NaN/Inf here would dominate the
        # cache-hit path; the encode worker checks values when it reads them.
        self._vconfig = ValidationConfig.from_settings(settings, check_values=False)

    def ec_transfer(self, mm_hash: str, deadline_ms: int | None) -> ECTransfer:
        """A signed entry for one item; it expires with the embedding's TTL or the deadline."""
        expires = now_ms() + self.settings.embedding_ttl_s * 1000
        if deadline_ms is not None:
            expires = min(expires, deadline_ms)
        key = embedding_key(self.settings.ec_namespace, self.model_fingerprint, mm_hash)
        return make_ec_transfer(
            mm_hash=mm_hash,
            store=self.store.url,
            key=key,
            expires_ms=expires,
            secret=self._secret,
        )

    async def _inline_or_claim(self, mm_hash: str, data: ItemData) -> ItemData:
        out: ItemData = {}
        for name, value in data.items():
            if isinstance(value, TensorRef):
                out[name] = value  # already claim-checked upstream
                continue
            nbytes = value.numel() * value.element_size()
            # Metadata (the grid) always travels inline: it is a few bytes, and the validator
            # and encoder need it without a store round trip (a claim-checked grid is rejected).
            if name in DEFAULT_METADATA_FIELDS or nbytes <= self.settings.inline_limit_bytes:
                out[name] = value
                continue
            # Copying and hashing megabytes takes milliseconds: keep it off the event loop.
            raw, digest = await asyncio.to_thread(_bytes_and_digest, value)
            key = claim_key(self.settings.ec_namespace, mm_hash, name)
            await self.store.put_bytes(key, raw, self.settings.embedding_ttl_s)
            out[name] = TensorRef(
                store=self.store.url,
                key=key,
                dtype=dtype_name(value.dtype),
                shape=list(value.shape),
                nbytes=len(raw),
                digest=digest,
            )
        return out

    async def plan(self, ev: RenderEvent) -> FanoutPlan:
        """Validate a RenderEvent and build its encode and prefill events (claim checks stored)."""
        validate_render_event(ev, self._vconfig)
        f = ev.features
        params = {h: self.ec_transfer(h, ev.deadline_ms) for _, _, h in _unique_items(f)}
        encode: list[EncodeEvent] = []
        cached: list[str] = []
        for modality, index, mm_hash in _unique_items(f):
            ec = params[mm_hash]
            # A hit must outlive the entry's promise (now + embedding_ttl_s): touch, not exists.
            if await self.store.touch(ec.key, self.settings.embedding_ttl_s):
                cached.append(mm_hash)
                continue
            data = (f.kwargs_data or {})[modality][index]
            assert data is not None  # validate_render_event: render items carry full data
            encode.append(
                EncodeEvent(
                    request_id=ev.request_id,
                    model=ev.model,
                    modality=modality,
                    item_index=index,
                    mm_hash=mm_hash,
                    data=await self._inline_or_claim(mm_hash, data),
                    ec_transfer=ec,
                    deadline_ms=ev.deadline_ms,
                    trace=dict(ev.trace),
                )
            )
        prefill = PrefillEvent(
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
        )
        return FanoutPlan(encode=encode, prefill=prefill, cached=cached)

    async def publish(self, ev: RenderEvent) -> FanoutStats:
        """Plan, then send encode events, the prefill event and a stage update."""
        if self.producer is None or self.prefill_producer is None:
            raise RuntimeError("FanOut.publish needs a producer")
        t0 = now_ms()
        plan = await self.plan(ev)
        codec = get_codec()
        encode_bytes = 0
        deliveries = []
        for enc in plan.encode:
            value = codec.encode(enc)
            encode_bytes += len(value)
            deliveries.append(
                await self.producer.send(
                    self.topics.encode,
                    value=value,
                    key=enc.mm_hash.encode(),
                    headers=event_headers(enc),
                )
            )
        # Encode events first, so an encoder can start while the prefill event is in flight.
        await asyncio.gather(*deliveries)
        prefill_value = codec.encode(plan.prefill)
        await self.prefill_producer.send_and_wait(
            self.topics.prefill,
            value=prefill_value,
            key=ev.request_id.encode(),
            headers=event_headers(plan.prefill),
        )
        stats = FanoutStats(
            encode_events=len(plan.encode),
            cache_hits=len(plan.cached),
            encode_bytes=encode_bytes,
            prefill_bytes=len(prefill_value),
            kwargs_bytes=kwargs_bytes(ev.features),
            cached=list(plan.cached),
        )
        await ResultReporter(self.producer, self.topics.results, "fanout")(
            ev.request_id,
            "encoding" if plan.encode else "prefilling",
            timings={"fanout": float(now_ms() - t0)},
            info={
                "encode_events": str(stats.encode_events),
                "cache_hits": str(stats.cache_hits),
                "encode_bytes": str(stats.encode_bytes),
                "prefill_bytes": str(stats.prefill_bytes),
            },
        )
        return stats


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
                meta = {k: v for k, v in full.items() if k in DEFAULT_METADATA_FIELDS} or None
            slots.append(meta)
        out[modality] = slots
    return out if any(m is not None for slots in out.values() for m in slots) else None


def _bytes_and_digest(t: torch.Tensor) -> tuple[bytes, str]:
    raw = tensor_bytes(t)
    return raw, blake3.blake3(raw).hexdigest()


def kwargs_bytes(features: Features) -> int:
    """Raw tensor bytes of every item's full processor output.

    A lower bound of what shipping ``kwargs_data`` to prefill costs (vLLM's JSON path adds
    base64's third on top).
    """
    total = 0
    for items in (features.kwargs_data or {}).values():
        for item in items:
            for v in (item or {}).values():
                total += v.nbytes if isinstance(v, TensorRef) else _nbytes(v)
    return total


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
