"""The decode stage's KV handoff: a prefill worker parks a request's KV cache in the store, a
decode worker reads it back and decodes from it.

One store entry per request (``put_tensors``: one key, one TTL, one digest), under
``{namespace}:kv:{model_fingerprint}:{request_id}``: every layer's keys and values (``k{i}``,
``v{i}``, each ``(1, kv_heads, prompt_len, head_dim)`` in the model's dtype) and the prompt's
last-position logits (``logits``), so the decode worker chooses the first token exactly as the
prefill worker would have. The event carries a :class:`schemas.types.KVTransfer` describing it,
HMAC-signed and bound to the request like an EC entry (``schemas.signing.sign_kv``). The bytes
round-trip exactly, so the tokens decoded from a parked cache are the tokens decoded in place.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from gpu_workers.compute import Prefilled, kv_bytes_per_token
from runtime.model import text_config
from runtime.stores.errors import StoreCorrupt, StoreKeyMissing
from schemas.keys import kv_key
from schemas.kv_entries import KVShape
from schemas.signing import sign_kv
from schemas.tensors import dtype_name
from schemas.types import KVTransfer, now_ms

if TYPE_CHECKING:
    from runtime.model import ModelBundle
    from runtime.settings import Settings
    from runtime.stores.base import EmbeddingStore

log = logging.getLogger(__name__)

LOGITS = "logits"


def kv_shape(bundle: ModelBundle) -> KVShape:
    """One cache position of ``bundle``'s language model."""
    tc = text_config(bundle.config)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return KVShape(
        int(tc.num_hidden_layers),
        int(tc.num_key_value_heads),
        int(head_dim),
        dtype_name(bundle.dtype),
    )


def kv_entry(
    settings: Settings,
    bundle: ModelBundle,
    store: EmbeddingStore,
    request_id: str,
    state: Prefilled,
    deadline_ms: int | None,
) -> KVTransfer:
    """The signed description of ``state`` parked for ``request_id`` (its expiry: the KV TTL,
    capped by the request's deadline)."""
    shape = kv_shape(bundle)
    if shape.bytes_per_position != kv_bytes_per_token(bundle):
        raise AssertionError("KV shape and KV bytes per position disagree")
    expires = now_ms() + settings.kv_ttl_s * 1000
    if deadline_ms is not None:
        expires = min(expires, deadline_ms)
    entry = KVTransfer(
        store=store.url,
        key=kv_key(settings.ec_namespace, bundle.fingerprint, request_id),
        expires_ms=expires,
        layers=shape.layers,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
        seq_len=state.prompt_len,
        next_position=list(state.next_position),
        nbytes=shape.bytes_per_position * state.prompt_len,
    )
    return sign_kv(settings.secret_bytes(), entry, request_id)


def kv_tensors(state: Prefilled) -> dict[str, torch.Tensor]:
    """The entry's tensors (on the CPU: what the Redis and shm stores hold)."""
    out: dict[str, torch.Tensor] = {}
    for i, (k, v, *_) in enumerate(state.cache):
        out[f"k{i}"] = k.detach().to("cpu").contiguous()
        out[f"v{i}"] = v.detach().to("cpu").contiguous()
    out[LOGITS] = state.logits.detach().to("cpu").contiguous()
    return out


async def park(store: EmbeddingStore, kv: KVTransfer, tensors: dict[str, torch.Tensor]) -> None:
    """Write the entry, with a TTL to its expiry."""
    ttl_s = max(1.0, (kv.expires_ms - now_ms()) / 1000)
    await store.put_tensors(kv.key, tensors, ttl_s)


async def fetch(store: EmbeddingStore, kv: KVTransfer) -> dict[str, torch.Tensor] | None:
    """The parked tensors, or None when they are gone (expired, evicted) or unusable (then a
    decode worker runs the prefill again rather than decode from a cache it cannot trust)."""
    try:
        tensors = await store.get_tensors(kv.key)
    except StoreKeyMissing:
        return None
    except StoreCorrupt as exc:
        log.warning("parked KV %s is unreadable (%s); running the prefill again", kv.key, exc)
        return None
    want = (1, kv.kv_heads, kv.seq_len, kv.head_dim)
    for i in range(kv.layers):
        for name in (f"k{i}", f"v{i}"):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != want or dtype_name(t.dtype) != kv.dtype:
                log.warning("parked KV %s: %s is not %s %s", kv.key, name, kv.dtype, want)
                return None
    if LOGITS not in tensors or tensors[LOGITS].ndim != 1:
        return None
    return tensors


def restore(bundle: ModelBundle, kv: KVTransfer, tensors: dict[str, torch.Tensor]) -> Prefilled:
    """The prefilled state the tensors hold, on the model's device (for the compute thread)."""
    dev = bundle.device
    layers = [(tensors[f"k{i}"].to(dev), tensors[f"v{i}"].to(dev)) for i in range(kv.layers)]
    cache = DynamicCache(ddp_cache_data=layers, config=text_config(bundle.config))
    t, h, w = (int(p) for p in kv.next_position)
    return Prefilled(
        cache=cache,
        logits=tensors[LOGITS].to(dev).float(),
        prompt_len=int(kv.seq_len),
        next_position=(t, h, w),
    )
