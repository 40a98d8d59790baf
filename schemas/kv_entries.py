"""The decode stage's rules: a ``DecodeEvent``'s parked-KV entry and what it passes through.

Rules (slug: what it rejects), beside those of :mod:`schemas.validator`:

- ``kv-key``: a KV entry whose key is not ``{namespace}:kv:{model_fingerprint}:{request_id}``
  for the event's own request (the fingerprint pinned when the config names one).
- ``kv-signature``: a KV entry whose HMAC does not verify for the event's request (only when a
  secret is configured): no KV reference without a valid signed entry.
- ``kv-store``: a KV entry naming another store than the worker reads (when the config names
  one).
- ``kv-shape``: a KV entry whose layers, KV heads, head size or dtype are not the model's
  (when the worker gives its :class:`KVShape`), whose length is not the prompt's, whose
  resume position is not three non-negative ints, or whose byte count does not follow.
- ``kv-transfer-params``: vLLM ``kv_transfer_params`` that are not a JSON object, or larger
  than ``MAX_KV_TRANSFER_PARAMS_BYTES``.

A KV entry past its expiry is no offence: the decode worker runs the prefill again instead.
``schemas.validator.validate_decode_event`` applies them to a whole event.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from schemas.defaults import MAX_KV_TRANSFER_PARAMS_BYTES
from schemas.ec_entries import without_credentials
from schemas.errors import ValidationError
from schemas.keys import kv_key
from schemas.signing import verify_kv
from schemas.types import DTYPE_SIZES, KVTransfer

if TYPE_CHECKING:
    from schemas.validation_config import ValidationConfig


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one position of a model's KV cache is: its layers, KV heads, head size, dtype."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def bytes_per_position(self) -> int:
        """Keys and values of every layer for one position."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]


def check_kv_transfer_params(text: str | None) -> None:
    """Rule ``kv-transfer-params``: None, or a JSON object of bounded size."""
    if text is None:
        return
    if len(text.encode()) > MAX_KV_TRANSFER_PARAMS_BYTES:
        raise ValidationError(
            "kv-transfer-params",
            f"kv_transfer_params are {len(text.encode())} bytes; at most "
            f"{MAX_KV_TRANSFER_PARAMS_BYTES}",
            field="kv_transfer_params",
        )
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValidationError(
            "kv-transfer-params",
            "kv_transfer_params must be the JSON text of an object",
            field="kv_transfer_params",
        )


def check_kv_entry(
    kv: KVTransfer,
    request_id: str,
    prompt_len: int,
    config: ValidationConfig,
    shape: KVShape | None = None,
) -> None:
    """Rules ``kv-key``, ``kv-signature``, ``kv-store``, ``kv-shape`` for one entry."""

    def bad(rule: str, why: str) -> ValidationError:
        return ValidationError(rule, why, field="kv")

    fingerprint = config.model_fingerprint
    if fingerprint is not None:
        ok_key = kv.key == kv_key(config.namespace, fingerprint, request_id)
    else:
        prefix = f"{config.namespace}:kv:"
        ok_key = kv.key.startswith(prefix) and kv.key.endswith(f":{request_id}")
    if not ok_key:
        expected = kv_key(config.namespace, fingerprint or "<model>", request_id)
        raise bad("kv-key", f"KV key {kv.key!r} is not {expected!r}")
    if config.secret is not None and not verify_kv(config.secret, kv, request_id):
        raise bad("kv-signature", f"the KV entry's signature does not verify for {request_id!r}")
    if config.store is not None and kv.store != config.store:
        raise bad(
            "kv-store",
            f"the KV entry names store {without_credentials(kv.store)!r}, this worker reads "
            f"{without_credentials(config.store)!r}",
        )
    if kv.dtype not in DTYPE_SIZES:
        raise bad("kv-shape", f"unknown KV dtype {kv.dtype!r}")
    got = KVShape(kv.layers, kv.kv_heads, kv.head_dim, kv.dtype)
    if shape is not None and got != shape:
        raise bad(
            "kv-shape",
            f"the KV cache is {dataclasses.astuple(got)} (layers, KV heads, head size, dtype); "
            f"this model's is {dataclasses.astuple(shape)}",
        )
    if kv.seq_len != prompt_len:
        raise bad("kv-shape", f"the KV cache holds {kv.seq_len} positions, the prompt {prompt_len}")
    if len(kv.next_position) != 3 or any(p < 0 for p in kv.next_position):
        raise bad("kv-shape", f"next_position {kv.next_position!r} is not three ints >= 0")
    if min(got.layers, got.kv_heads, got.head_dim) <= 0 or kv.nbytes != (
        got.bytes_per_position * kv.seq_len
    ):
        raise bad("kv-shape", f"nbytes {kv.nbytes} does not follow from the KV entry's shape")
