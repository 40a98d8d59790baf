"""The worker side's store I/O: load planned items into vLLM's encoder cache, save one.

Both run on the connector's store thread and wait for it, bounded by ``io_timeout_s``. A save
waits until the value is written because the scheduler signs the item's entry as soon as the
step's request finishes (:func:`epd_vllm_ec.scheduler_side.producer_entries` touches the key
first): an entry must never be handed out for a value still on its way. The only copy made on
vLLM's thread is the device-to-host copy that a store write needs anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epd_vllm_ec.framing import check_loaded, nbytes, store_value, vllm_output
from epd_vllm_ec.scheduler_side import LoadItem
from epd_vllm_ec.settings import ConnectorSettings
from epd_vllm_ec.store_thread import StoreThread
from runtime.stores.base import EmbeddingStore


class ECLoadError(RuntimeError):
    """A planned item could not be loaded (lost from the store since the scheduler touched it,
    or not an encoder output of the expected length). vLLM cannot compute an item it planned
    as loaded, so the step fails with this message rather than vLLM's bare cache miss."""


def load_items(
    thread: StoreThread,
    settings: ConnectorSettings,
    loads: Sequence[LoadItem],
    encoder_cache: dict[str, torch.Tensor],
    *,
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> list[str]:
    """Read every planned item not already in ``encoder_cache`` (one batched read) and place
    it there, on ``device`` in ``dtype`` (None: as stored). Returns the mm_hashes loaded."""
    todo = [item for item in loads if item.mm_hash not in encoder_cache]
    if not todo:
        return []
    keys = [item.key for item in todo]

    async def op(store: EmbeddingStore) -> list[torch.Tensor]:
        return await store.get_many(keys)

    try:
        values = thread.call(op, settings.io_timeout_s)
        outputs = [vllm_output(v, item.key) for v, item in zip(values, todo, strict=True)]
        for output, item in zip(outputs, todo, strict=True):
            check_loaded(output, item.key, item.rows, settings.max_item_bytes)
    except Exception as exc:
        raise ECLoadError(f"loading encoder outputs {keys} failed: {exc}") from exc
    for output, item in zip(outputs, todo, strict=True):
        encoder_cache[item.mm_hash] = output.to(device=device, dtype=dtype or output.dtype)
    return [item.mm_hash for item in todo]


def save_item(
    thread: StoreThread,
    settings: ConnectorSettings,
    key: str,
    output: torch.Tensor,
    deepstack_levels: int,
) -> None:
    """Write one encoder output under ``key`` in our framing, with the settings' TTL."""
    if nbytes(output) > settings.max_item_bytes:
        raise ValueError(
            f"encoder output for {key!r} is {nbytes(output)} bytes, over max_item_bytes "
            f"{settings.max_item_bytes}"
        )
    value = store_value(output, deepstack_levels)

    async def op(store: EmbeddingStore) -> None:
        if isinstance(value, dict):
            await store.put_tensors(key, value, settings.ttl_s)
        else:
            await store.put(key, value, settings.ttl_s)

    thread.call(op, settings.io_timeout_s)
