"""``EPDStoreECConnector``: vLLM's ``ECConnectorBase`` over our embedding stores.

The module vLLM loads by ``ec_connector_module_path`` (``epd_vllm_ec.connector``); the only
one of this package that imports vLLM. The decisions live in the vLLM-free modules beside it
(:mod:`~epd_vllm_ec.scheduler_side`, :mod:`~epd_vllm_ec.worker_side`); this class maps vLLM's
calls onto them:

- scheduler, consumer: ``ensure_cache_available`` verifies the request's entries and touches
  their keys; ``has_cache_item`` is true only for an item so trusted; ``update_state_after_alloc``
  plans its load; ``build_connector_meta`` hands the plans to the workers;
  ``take_unavailable_requests`` fails a request whose refused item has no media to encode;
- scheduler, producer: ``has_cache_item`` is a store hit on our key (the item is not encoded
  again); ``request_finished`` returns a signed entry per stored item as the response's
  ``ec_transfer_params``;
- worker: ``start_load_caches`` reads the planned items into vLLM's encoder cache;
  ``save_caches`` writes an encoder output under our key.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)

from epd_vllm_ec.entries import item_key
from epd_vllm_ec.scheduler_side import (
    ConsumerGate,
    LoadItem,
    producer_entries,
    touch_all,
    wall_ms,
)
from epd_vllm_ec.settings import connector_settings
from epd_vllm_ec.store_thread import StoreThread
from epd_vllm_ec.worker_side import load_items, save_item
from runtime.stores.errors import StoreError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class EPDStoreECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> worker: the items to load this step."""

    def __init__(self, loads: list[LoadItem]) -> None:
        self.loads = loads


def deepstack_levels_of(vllm_config: Any) -> int:
    """Deepstack levels in the model's encoder output (Qwen3-VL), 0 for other models."""
    hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
    indexes = getattr(getattr(hf, "vision_config", None), "deepstack_visual_indexes", None)
    return len(indexes) if indexes else 0


def target_device() -> torch.device:
    """Where vLLM's encoder cache lives on this worker (the CPU when no accelerator is set)."""
    from vllm.platforms import current_platform

    kind = current_platform.device_type
    if not kind:
        return torch.device("cpu")
    if current_platform.is_cuda_alike():
        return torch.device(kind, current_platform.current_device())
    return torch.device(kind)


class EPDStoreECConnector(ECConnectorBase):
    """vLLM's EC connector over ``redis://``, ``redis+cluster://`` and ``shm://`` stores."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        """Read the extra config (:func:`~epd_vllm_ec.settings.connector_settings`) and open
        the store on the connector's own loop thread."""
        super().__init__(vllm_config=vllm_config, role=role)
        ec_config = vllm_config.ec_transfer_config
        assert ec_config is not None  # the base class refused a config without one
        self.settings = connector_settings(ec_config.ec_connector_extra_config)
        levels = self.settings.deepstack_levels
        self.deepstack_levels = deepstack_levels_of(vllm_config) if levels is None else levels
        model_config = getattr(vllm_config, "model_config", None)
        self.dtype: torch.dtype | None = getattr(model_config, "dtype", None)
        self.io = StoreThread(self.settings.store_url)
        self.gate = ConsumerGate(self.settings, self.io)

    def shutdown(self) -> None:
        """Close the store and its thread."""
        self.io.close()

    # --- scheduler side -----------------------------------------------------------------

    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Consumer: judge the request's entries (once per item); False when it must fail."""
        if not self.is_consumer:
            return True
        return self.gate.admit(request)

    def has_cache_item(self, identifier: str) -> bool:
        """Consumer: a verified entry with a live key stands behind ``identifier``.
        Producer: our key for it is in the store already (a hit, touched: not encoded again)."""
        if self.is_consumer and self.gate.trusted(identifier):
            return True
        if not self.is_producer:
            return False
        key = item_key(self.settings, identifier)
        try:
            return touch_all(self.io, [key], self.settings.ttl_s, self.settings.io_timeout_s)[0]
        except (StoreError, OSError) as exc:
            # Called from vLLM's scheduler: an error here would stop the engine and every
            # request in it. A store that cannot answer only means the item is encoded here.
            log.warning("ec store unreadable for %s (%r): the item is encoded", identifier, exc)
            return False

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        """Consumer: plan loading the allocated item when it is trusted."""
        if self.is_consumer:
            mm_hash = request.mm_features[index].identifier
            self.gate.plan_load(mm_hash, request.get_num_encoder_embeds(index))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        """This step's planned loads (and forget them)."""
        return EPDStoreECConnectorMetadata(self.gate.take_loads())

    def take_unavailable_requests(self) -> set[str]:
        """Requests with a refused item and no media to encode it from."""
        return self.gate.take_unavailable()

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """Producer: the signed entries of the request's stored items (its response's
        ``ec_transfer_params``). Consumer: forget the request's trusted items."""
        self.gate.finished(request.request_id)
        if not self.is_producer or not request.mm_features:
            return False, None
        hashes = [f.identifier for f in request.mm_features]
        try:
            entries = producer_entries(self.settings, self.io, hashes, wall_ms())
        except Exception:
            log.exception("EC producer: signing entries for request %s", request.request_id)
            return False, None
        return False, entries or None

    # --- worker side --------------------------------------------------------------------

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        """Load this step's planned items into ``encoder_cache`` (raises ``ECLoadError``)."""
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, EPDStoreECConnectorMetadata)
        load_items(
            self.io,
            self.settings,
            metadata.loads,
            encoder_cache,
            device=target_device(),
            dtype=self.dtype,
        )

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Producer: write the item's encoder output under our key. A failed write is logged,
        not raised: the item then gets no entry, and its consumer encodes it or fails it."""
        if not self.is_producer:
            return
        key = item_key(self.settings, mm_hash)
        try:
            save_item(self.io, self.settings, key, encoder_cache[mm_hash], self.deepstack_levels)
        except Exception:
            log.exception("EC producer: saving %s under %r", mm_hash, key)
