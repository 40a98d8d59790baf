"""The encode stage on a vLLM encoder instance (``EPD_ENGINE=vllm``, ``EPD_VLLM_ENCODE_URL``).

An encoder instance is a ``vllm serve`` with ``--ec-transfer-config`` in the ``ec_producer``
role: given a request whose item carries its encoder inputs, vLLM's vision tower runs and its EC
connector writes the item's encoder output where the item's ``ec_transfer_params`` entry says
(our store, our key). The encode worker sends each :class:`EncodeEvent` as such a request: the
item alone (its placeholder run as the whole prompt), its ``pixel_values`` and grid in
``kwargs_data``, its metadata, its EC entry, one token to generate (as vLLM's own EPD proxy
drives its encoders). The item counts as ``encoded`` only once its entry is in our store: the
worker reads it back (:func:`gpu_workers.entries.fetch_outputs`), so a connector that did not
write it is a retried failure, never a false ``encoded``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from gpu_workers.entries import fetch_outputs
from gpu_workers.vllm_engine.client import VllmClient
from runtime.model import placeholder_ids
from schemas.vllm_generate import VllmUnavailable, ec_params_json, parse_response
from schemas.vllm_wire import encode_item

if TYPE_CHECKING:
    import torch

    from gpu_workers.compute import EncoderOutput
    from gpu_workers.context import WorkerContext
    from schemas.types import EncodeEvent

ENTRY_WAIT_S = 5.0
"""How long the entry may take to show in the store after vLLM answered (a connector that
writes asynchronously); past it the try fails and is retried."""


def encode_body(
    ev: EncodeEvent,
    tensors: dict[str, torch.Tensor],
    grid_name: str,
    pad_id: int,
    merge_size: int,
) -> dict[str, Any]:
    """The ``GenerateRequest`` that has an encoder instance encode ``ev``'s item."""
    grid = tensors[grid_name]
    length = int(grid.prod()) // (merge_size * merge_size)
    meta = {k: v for k, v in tensors.items() if k == grid_name or k == "second_per_grid_ts"}
    m = ev.modality
    return {
        "request_id": f"{ev.request_id}-enc-{m}{ev.item_index}",
        "token_ids": [pad_id] * length,
        "features": {
            "mm_hashes": {m: [ev.mm_hash]},
            "mm_placeholders": {m: [{"offset": 0, "length": length}]},
            "kwargs_data": {m: [encode_item(tensors)]},
            "mm_metadata": {m: [encode_item(meta)]},
        },
        "sampling_params": {"max_tokens": 1, "temperature": 0.0},
        "stream": False,
        "ec_transfer_params": ec_params_json({ev.mm_hash: ev.ec_transfer}),
    }


class VllmEncoder:
    """Has vLLM encoder instances encode items into our store, and checks they did."""

    def __init__(self, ctx: WorkerContext) -> None:
        s = ctx.settings
        urls = s.vllm_urls("encode")
        if not urls:
            raise ValueError("EPD_ENGINE=vllm needs EPD_VLLM_ENCODE_URL (the vLLM encoders)")
        self.ctx = ctx
        self.client = VllmClient.for_settings(urls, s)
        self.pad_ids = placeholder_ids(ctx.bundle)

    async def close(self) -> None:
        await self.client.close()

    async def encode(
        self, ev: EncodeEvent, tensors: dict[str, torch.Tensor], grid_name: str
    ) -> EncoderOutput:
        """The item encoded by vLLM: its entry as read back from our store."""
        body = encode_body(
            ev, tensors, grid_name, self.pad_ids[ev.modality], self.ctx.bundle.merge_size
        )
        resp = await self.client.post_whole(body)
        parse_response(resp)  # an ErrorResponse raises (the body's fault: rejected; else retried)
        key, store = ev.ec_transfer.key, self.ctx.store
        deadline = time.monotonic() + ENTRY_WAIT_S
        while not await store.exists(key):
            if time.monotonic() > deadline:
                raise VllmUnavailable(
                    f"vLLM answered the encode of {ev.mm_hash[:16]} but its entry is not in the "
                    f"store at {key} (is the encoder's EC connector pointed at this store?)"
                )
            await asyncio.sleep(0.05)
        return (await fetch_outputs(store, [key], self.ctx.bundle.family))[0]
