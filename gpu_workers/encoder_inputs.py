"""An encode event's inputs: carried in the event or claim-checked in the store, verified, and
checked against the model before the vision tower sees them.

A claim-checked input (a :class:`~schemas.types.TensorRef`) is read only from this worker's
store and namespace, its digest and values checked once the bytes are here; one that is gone
from the store is :class:`InputLost` (``failed``/``input-lost``: it was valid when it was sent).
Once the item's embedding is stored, its claims are garbage: :meth:`EncoderInputs.drop_claims`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import blake3
import torch

from runtime.model import vision_config
from runtime.stores.errors import StoreError, StoreKeyMissing
from schemas.errors import ValidationError
from schemas.keys import claim_key
from schemas.modalities import GRID_FIELDS, MAIN_ENCODER_INPUT
from schemas.tensors import tensor_from_bytes
from schemas.types import EncodeEvent, ErrorInfo, TensorRef
from schemas.validator import check_tensor

if TYPE_CHECKING:
    from prometheus_client import Counter

    from runtime.model import ModelBundle
    from runtime.stores.base import EmbeddingStore
    from schemas.validator import ValidationConfig

log = logging.getLogger(__name__)


class InputLost(Exception):
    """A claim-checked input that is not in the store any more: retrying cannot bring it
    back, and it was valid when it was sent (``failed``/``input-lost``, never ``rejected``)."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info


def encoder_fields(ev: EncodeEvent, bundle: ModelBundle) -> tuple[str, str]:
    """The names of the item's pixels and grid fields, for a modality the model encodes."""
    pv_name = MAIN_ENCODER_INPUT.get(ev.modality)
    grid_name = GRID_FIELDS.get(ev.modality)
    if pv_name is None or grid_name is None or ev.modality not in bundle.family.modalities:
        raise ValidationError(
            "encode-inputs",
            f"modality {ev.modality!r} has no vision encoder here; supported: "
            f"{sorted(MAIN_ENCODER_INPUT)}",
            modality=ev.modality,
            item=ev.item_index,
        )
    return pv_name, grid_name


def check_patch_width(
    pixels: torch.Tensor, name: str, ev: EncodeEvent, bundle: ModelBundle
) -> None:
    """Rows were checked against the grid; the width is the model's. A wrong width would fail
    torch.cat for every item of the micro-batch, not just this one."""
    vc = vision_config(bundle.config)
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    if pixels.ndim != 2 or pixels.shape[1] != width:
        raise ValidationError(
            "encode-inputs",
            f"{name} has shape {list(pixels.shape)}; this model takes (patches, {width})",
            modality=ev.modality,
            item=ev.item_index,
            field=name,
        )


class EncoderInputs:
    """Reads an encode event's tensors (claim checks from ``store``) and drops its claims."""

    def __init__(
        self,
        store: EmbeddingStore,
        namespace: str,
        vconfig: ValidationConfig,
        bytes_in: Counter,
        *,
        worker_id: str,
    ) -> None:
        """``namespace``: ``EPD_EC_NAMESPACE``, the only one claims are read (and deleted)
        in; ``bytes_in``: the claim bytes read, counted."""
        self.store = store
        self.namespace = namespace
        self.vconfig = vconfig
        self.bytes_in = bytes_in
        self.worker_id = worker_id
        self.deleted = 0
        """Claims deleted once their item's embedding was stored."""

    async def read(
        self, ev: EncodeEvent, pv_name: str, grid_name: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The item's pixels and grid, read from the store where claim-checked, and checked."""
        pixels = await self._tensor(ev.data[pv_name], pv_name, ev)
        grid = await self._tensor(ev.data[grid_name], grid_name, ev)
        return pixels, grid

    async def _tensor(
        self, value: torch.Tensor | TensorRef, name: str, ev: EncodeEvent
    ) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        if value.store != self.store.url:
            raise ValidationError(
                "claim-check",
                f"TensorRef points at store {value.store!r}, this worker reads {self.store.url!r}",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
        if not value.key.startswith(f"{self.namespace}:"):
            raise ValidationError(
                "ec-namespace",
                f"claim-check key {value.key!r} is outside namespace {self.namespace!r}",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
        raw = await self._claimed_bytes(value, name, ev)
        # Hashing and scanning megabytes takes milliseconds: keep it off the event loop.
        return await asyncio.to_thread(self._verified, value, raw, name, ev)

    async def _claimed_bytes(self, value: TensorRef, name: str, ev: EncodeEvent) -> bytes:
        try:
            raw = await self.store.get_bytes(value.key)
        except StoreKeyMissing:
            # The fan-out stores the input before it sends the event: missing means it expired
            # while queued or was lost with the store. Ours to report, not the request's fault.
            raise InputLost(
                ErrorInfo(
                    "input-lost",
                    f"claim-checked input {value.key!r} is gone from the store (expired while "
                    "queued, or lost with a store restart); resubmit the request",
                    rule="claim-check",
                    modality=ev.modality,
                    item=ev.item_index,
                    field=name,
                )
            ) from None
        self.bytes_in.inc(len(raw))
        return raw

    def _verified(self, ref: TensorRef, raw: bytes, name: str, ev: EncodeEvent) -> torch.Tensor:
        if blake3.blake3(raw).hexdigest() != ref.digest:
            raise ValidationError(
                "claim-check",
                f"digest mismatch for {ref.key!r}",
                modality=ev.modality,
                item=ev.item_index,
                field=name,
            )
        tensor = tensor_from_bytes(ref.dtype, ref.shape, raw)
        # The event only carried the reference: check the values now that we hold them.
        check_tensor(tensor, self.vconfig, modality=ev.modality, item=ev.item_index, name=name)
        return tensor

    async def drop_claims(self, ev: EncodeEvent) -> None:
        """Delete this item's claim-checked inputs (megabytes each) once its embedding is stored.

        Only keys the fan-out would have written for this item (:func:`claim_key`) in this
        worker's store are deleted, so an event cannot name another key for deletion. A failed
        delete is logged, not raised: the claim's own TTL removes it anyway.
        """
        for name, value in ev.data.items():
            if not isinstance(value, TensorRef) or value.store != self.store.url:
                continue
            # The signed entry's key ends with the fan-out's own hash, which the claims use too
            # (it equals mm_hash except for a vLLM render's foreign label).
            key_hash = ev.ec_transfer.key.rpartition(":")[2]
            if value.key != claim_key(self.namespace, key_hash, name):
                continue
            try:
                await self.store.delete(value.key)
                self.deleted += 1
            except StoreError as exc:
                log.warning("%s: could not delete claim %s (%r)", self.worker_id, value.key, exc)
