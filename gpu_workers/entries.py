"""An item's embedding-store entry, by model family: what the encode worker writes and what the
prefill worker reads back and places in the prompt.

The family table (``schemas/families.py``) says what the vision tower yields per item. A family
with one output (Qwen2-VL, Qwen2.5-VL) stores the embedding as a plain tensor value; a family with
more (Qwen3-VL: embedding + deepstack features) stores them all as ONE multi-tensor entry (one
key, one TTL, one digest), so prefill can never see an embedding without its deepstack features.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gpu_workers.compute import EncoderOutput, ItemEmbedding, item_embedding
from runtime.processor_limits import input_limits
from runtime.stores.errors import StoreCorrupt
from schemas.errors import ComputeError, ValidationError
from schemas.families import EMBEDS, ModelFamily
from schemas.modalities import GRID_FIELDS
from schemas.types import Features
from schemas.validator import ValidationConfig

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.settings import Settings
    from runtime.status import CancelWatch
    from runtime.stores.base import EmbeddingStore


def worker_validation(
    settings: Settings, bundle: ModelBundle, store: EmbeddingStore | None = None
) -> ValidationConfig:
    """The encode/prefill gate for ``bundle``: strict, keys pinned to its fingerprint, entries
    pinned to ``store`` (rule ``ec-store``), and its family's own metadata fields and merge size
    (a Qwen2-VL worker refuses Qwen2.5-VL's ``second_per_grid_ts`` by rule ``metadata-field``
    instead of ignoring it)."""
    return ValidationConfig.for_worker(
        settings,
        bundle.fingerprint,
        store=store.url if store is not None else None,
        metadata_fields=bundle.family.metadata_fields,
        merge_size=bundle.merge_size,
        # The same derived limit as the fan-out's: what the processor can emit, the worker reads.
        max_tensor_bytes=input_limits(settings, bundle.image_processor).max_tensor_bytes,
    )


async def store_outputs(
    store: EmbeddingStore,
    key: str,
    outputs: EncoderOutput,
    family: ModelFamily,
    ttl_s: float | None,
) -> None:
    """Write one item's encoder outputs under ``key`` in the family's entry shape."""
    missing = [n for n in family.encoder_outputs if n not in outputs]
    if missing:
        raise ComputeError(f"encoder outputs lack {missing} for {family.display_name}")
    if family.encoder_outputs == (EMBEDS,):
        await store.put(key, outputs[EMBEDS], ttl_s)
    else:
        await store.put_tensors(key, {n: outputs[n] for n in family.encoder_outputs}, ttl_s)


async def fetch_outputs(
    store: EmbeddingStore, keys: Sequence[str], family: ModelFamily
) -> list[EncoderOutput]:
    """Read the entries of ``keys`` (one batched read); each must hold every output the family
    needs, or :class:`StoreCorrupt` names the key."""
    if family.encoder_outputs == (EMBEDS,):
        return [{EMBEDS: t} for t in await store.get_many(keys)]
    entries = await store.get_tensors_many(keys)
    for k, entry in zip(keys, entries, strict=True):
        missing = [n for n in family.encoder_outputs if n not in entry]
        if missing:
            raise StoreCorrupt(f"entry {k!r} lacks {missing} ({family.display_name})")
    return entries


def items_from_features(
    features: Features, outputs: Mapping[str, EncoderOutput]
) -> list[ItemEmbedding]:
    """Every item of ``features`` as an ``ItemEmbedding`` (offset order): its placeholder, its
    ``mm_metadata`` (grid and e.g. video timing) and its encoder outputs by mm_hash.

    A missing grid is rule ``metadata-missing`` naming the item.
    """
    items = []
    meta = features.mm_metadata or {}
    for modality, index, mm_hash in features.items():
        ph = features.mm_placeholders[modality][index]
        grid_field = GRID_FIELDS.get(modality)
        item_meta = meta.get(modality, [None] * (index + 1))[index] or {}
        if grid_field is None or item_meta.get(grid_field) is None:
            raise ValidationError(
                "metadata-missing",
                f"{grid_field or 'grid'} is needed for M-RoPE positions",
                modality=modality,
                item=index,
            )
        items.append(
            item_embedding(modality, ph.offset, ph.length, outputs[mm_hash], item_meta, ph.is_embed)
        )
    items.sort(key=lambda it: it.offset)
    return items


async def request_cancelled(cancel: CancelWatch | None, request_id: str) -> bool:
    """Whether ``request_id`` was cancelled (False for a worker without a cancel watch)."""
    return cancel is not None and await cancel.is_cancelled(request_id)
